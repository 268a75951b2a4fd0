"""``opacus.accountants``: the accountants under Opacus' names (implementation: dptorch.accounting)."""

from dptorch.opacus_compat import (
    GaussianAccountant,
    IAccountant,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    create_accountant,
)

__all__ = ["GaussianAccountant", "IAccountant", "PLDAccountant", "PRVAccountant", "RDPAccountant", "create_accountant"]
