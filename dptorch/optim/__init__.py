"""DP optimizers: the clipped sum, the noise and the inner step (clip-factor rules: ``dptorch.clipping``)."""

from dptorch.clipping import CLIPPING_MODES, AdaptiveClipping, NonFiniteGradientWarning, clip_factors
from dptorch.optim.adaclip import AdaClipDPOptimizer
from dptorch.optim.captured_step import CaptureRefused, CapturedStep, capture_step
from dptorch.optim.loss_scaling import DPGradScaler
from dptorch.optim.optimizer import DPOptimizer

__all__ = [
    "CLIPPING_MODES", "AdaClipDPOptimizer", "AdaptiveClipping", "CapturedStep", "DPGradScaler", "DPOptimizer",
    "NonFiniteGradientWarning", "CaptureRefused", "capture_step", "clip_factors",
]
