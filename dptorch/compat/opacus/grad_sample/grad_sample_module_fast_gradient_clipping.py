"""``opacus.grad_sample.grad_sample_module_fast_gradient_clipping``: GradSampleModuleFastGradientClipping
(implementation: dptorch.grad_sample.fast_gradient_clipping)."""

from dptorch.grad_sample import GradSampleModuleFastGradientClipping

__all__ = ["GradSampleModuleFastGradientClipping"]
