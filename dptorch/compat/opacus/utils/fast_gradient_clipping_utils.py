"""``opacus.utils.fast_gradient_clipping_utils``: DPLossFastGradientClipping (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import DPLossFastGradientClipping

__all__ = ["DPLossFastGradientClipping"]
