"""``opacus.schedulers.noise_scheduler`` (implementation: dptorch.optim.schedulers)."""

from dptorch.optim.schedulers import ExponentialNoise, LambdaNoise, StepNoise, _NoiseScheduler

__all__ = ["ExponentialNoise", "LambdaNoise", "StepNoise", "_NoiseScheduler"]
