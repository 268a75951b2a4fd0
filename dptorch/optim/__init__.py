"""DP optimizers and clipping."""

from dptorch.optim.clipping import CLIPPING_MODES, clip_factors
from dptorch.optim.optimizer import DPOptimizer

__all__ = ["CLIPPING_MODES", "DPOptimizer", "clip_factors"]
