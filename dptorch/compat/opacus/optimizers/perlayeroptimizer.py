"""``opacus.optimizers.perlayeroptimizer``: DPPerLayerOptimizer (per-layer clipping; see dptorch.compat.opacus)."""

from dptorch.compat.opacus import DPPerLayerOptimizer

__all__ = ["DPPerLayerOptimizer"]
