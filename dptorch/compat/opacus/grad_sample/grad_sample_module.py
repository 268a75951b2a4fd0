"""``opacus.grad_sample.grad_sample_module``: GradSampleModule, GradSampleHooks (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import GradSampleHooks, GradSampleModule

__all__ = ["GradSampleHooks", "GradSampleModule"]
