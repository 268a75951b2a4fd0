"""``opacus.optimizers.optimizer_fast_gradient_clipping``: DPOptimizerFastGradientClipping (the one DPOptimizer (ghost clipping is the controller's mode); see dptorch.compat.opacus)."""

from dptorch.compat.opacus import DPOptimizerFastGradientClipping

__all__ = ["DPOptimizerFastGradientClipping"]
