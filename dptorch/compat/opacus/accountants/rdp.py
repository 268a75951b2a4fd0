"""``opacus.accountants.rdp``: RDPAccountant (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import RDPAccountant

__all__ = ["RDPAccountant"]
