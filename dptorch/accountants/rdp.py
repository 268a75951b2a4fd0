"""``opacus.accountants.rdp``: RDPAccountant (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import RDPAccountant

__all__ = ["RDPAccountant"]
