"""``opacus.optimizers.adaclipoptimizer``: AdaClipDPOptimizer (adaptive clipping; see dptorch.compat.opacus)."""

from dptorch.compat.opacus import AdaClipDPOptimizer

__all__ = ["AdaClipDPOptimizer"]
