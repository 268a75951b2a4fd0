"""``opacus.schedulers.grad_clip_scheduler`` (implementation: dptorch.optim.schedulers)."""

from dptorch.optim.schedulers import ExponentialGradClip, LambdaGradClip, StepGradClip, _GradClipScheduler

__all__ = ["ExponentialGradClip", "LambdaGradClip", "StepGradClip", "_GradClipScheduler"]
