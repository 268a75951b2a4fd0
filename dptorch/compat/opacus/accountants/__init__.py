"""``opacus.accountants``: the accountants under Opacus' names (implementation: dptorch.accounting), and
Opacus 1.6's registry (``register_accountant``, the ``registry`` module)."""

from dptorch.compat.opacus import (
    GaussianAccountant,
    IAccountant,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    create_accountant,
)
from dptorch.compat.opacus.accountants import registry
from dptorch.compat.opacus.accountants.registry import register_accountant

__all__ = ["GaussianAccountant", "IAccountant", "PLDAccountant", "PRVAccountant", "RDPAccountant", "create_accountant", "register_accountant", "registry"]
