"""Per-sample gradients: the GradSampleHooks controller, the optional wrapper and the registry.

Importing the package registers the built-in layer families (``layers``) into the registry.
"""

from dptorch.grad_sample.errors import PerSampleGradientError, UnsupportedModuleError
from dptorch.grad_sample.hooks import GradSampleHooks
from dptorch.grad_sample import layers  # noqa: F401  (import registers the built-in layer families)
from dptorch.grad_sample.module import GradSampleModule
from dptorch.grad_sample.fast_gradient_clipping import GradSampleHooksFastGradientClipping, GradSampleModuleFastGradientClipping
from dptorch.grad_sample.registry import find_grad_sampler, register_duck_grad_sampler, register_grad_sampler
from dptorch.grad_sample.tracking import register_batch_rule, remove_batch_rule
from dptorch.grad_sample.validation import incompatibilities, register_module_check

__all__ = [
    "GradSampleHooks",
    "GradSampleHooksFastGradientClipping",
    "GradSampleModule",
    "GradSampleModuleFastGradientClipping",
    "PerSampleGradientError",
    "UnsupportedModuleError",
    "find_grad_sampler",
    "incompatibilities",
    "register_batch_rule",
    "register_duck_grad_sampler",
    "register_grad_sampler",
    "register_module_check",
    "remove_batch_rule",
]
