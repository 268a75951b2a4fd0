"""``opacus.grad_sample.grad_sample_module``: GradSampleModule, GradSampleHooks (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import GradSampleHooks, GradSampleModule

__all__ = ["GradSampleHooks", "GradSampleModule"]
