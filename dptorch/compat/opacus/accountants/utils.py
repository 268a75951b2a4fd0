"""``opacus.accountants.utils``: get_noise_multiplier (its default accountant is dptorch's, "pld")."""

from dptorch.compat.opacus import get_noise_multiplier

__all__ = ["get_noise_multiplier"]
