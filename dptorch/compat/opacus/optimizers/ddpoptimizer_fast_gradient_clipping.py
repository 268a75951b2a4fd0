"""``opacus.optimizers.ddpoptimizer_fast_gradient_clipping``: DistributedDPOptimizerFastGradientClipping (the one DPOptimizer (ghost clipping is the controller's mode); see dptorch.compat.opacus)."""

from dptorch.compat.opacus import DistributedDPOptimizerFastGradientClipping

__all__ = ["DistributedDPOptimizerFastGradientClipping"]
