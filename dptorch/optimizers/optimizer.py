"""``opacus.optimizers.optimizer``: DPOptimizer (implementation: dptorch.optim.optimizer)."""

from dptorch.opacus_compat import DPOptimizer

__all__ = ["DPOptimizer"]
