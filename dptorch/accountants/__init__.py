"""``opacus.accountants``: the accountants under Opacus' names (implementation: dptorch.accounting)."""

from dptorch.opacus_compat import (
    ACCOUNTANTS_UNMAPPED,
    GaussianAccountant,
    IAccountant,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    create_accountant,
    unmapped_names,
)

__all__ = ["GaussianAccountant", "IAccountant", "PLDAccountant", "PRVAccountant", "RDPAccountant", "create_accountant"]
__getattr__ = unmapped_names(__name__, ACCOUNTANTS_UNMAPPED)
