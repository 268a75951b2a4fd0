"""``opacus.optimizers.ddpoptimizer``: DistributedDPOptimizer (the one DPOptimizer, which sums the clipped gradients of all ranks and draws the noise once; see dptorch.compat.opacus)."""

from dptorch.compat.opacus import DistributedDPOptimizer

__all__ = ["DistributedDPOptimizer"]
