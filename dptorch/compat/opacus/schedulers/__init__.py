"""``opacus.schedulers``: noise-multiplier and clipping-bound schedules (implementation: dptorch.optim.schedulers)."""

from dptorch.optim.schedulers import (
    ExponentialGradClip,
    ExponentialNoise,
    LambdaGradClip,
    LambdaNoise,
    StepGradClip,
    StepNoise,
    _GradClipScheduler,
    _NoiseScheduler,
)

__all__ = [
    "ExponentialGradClip", "ExponentialNoise", "LambdaGradClip", "LambdaNoise", "StepGradClip", "StepNoise",
    "_GradClipScheduler", "_NoiseScheduler",
]
