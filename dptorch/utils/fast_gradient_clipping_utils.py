"""``opacus.utils.fast_gradient_clipping_utils``: DPLossFastGradientClipping (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import DPLossFastGradientClipping

__all__ = ["DPLossFastGradientClipping"]
