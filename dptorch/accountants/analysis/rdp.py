"""``opacus.accountants.analysis.rdp``: compute_rdp, get_privacy_spent (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import compute_rdp, get_privacy_spent

__all__ = ["compute_rdp", "get_privacy_spent"]
