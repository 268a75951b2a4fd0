"""``opacus.optimizers.optimizer``: DPOptimizer (implementation: dptorch.optim.optimizer)."""

from dptorch.compat.opacus import DPOptimizer

__all__ = ["DPOptimizer"]
