"""``opacus.accountants.analysis.rdp``: compute_rdp, get_privacy_spent (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import compute_rdp, get_privacy_spent

__all__ = ["compute_rdp", "get_privacy_spent"]
