"""``opacus.optimizers.ddp_perlayeroptimizer``: DistributedPerLayerOptimizer, SimpleDistributedPerLayerOptimizer (per-layer clipping over several processes; see dptorch.compat.opacus)."""

from dptorch.compat.opacus import DistributedPerLayerOptimizer, SimpleDistributedPerLayerOptimizer

__all__ = ["DistributedPerLayerOptimizer", "SimpleDistributedPerLayerOptimizer"]
