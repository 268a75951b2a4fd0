"""DP optimizers and clipping."""

from dptorch.optim.adaclip import AdaClipDPOptimizer
from dptorch.optim.adaptive import AdaptiveClipping
from dptorch.optim.clipping import CLIPPING_MODES, NonFiniteGradientWarning, clip_factors
from dptorch.optim.optimizer import DPOptimizer

__all__ = [
    "CLIPPING_MODES", "AdaClipDPOptimizer", "AdaptiveClipping", "DPOptimizer", "NonFiniteGradientWarning", "clip_factors",
]
