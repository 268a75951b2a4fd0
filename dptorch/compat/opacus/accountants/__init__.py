"""``opacus.accountants``: the accountants under Opacus' names (implementation: dptorch.accounting)."""

from dptorch.compat.opacus import (
    GaussianAccountant,
    IAccountant,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    create_accountant,
)

__all__ = ["GaussianAccountant", "IAccountant", "PLDAccountant", "PRVAccountant", "RDPAccountant", "create_accountant"]
