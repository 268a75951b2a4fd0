"""Per-sample gradients: the public surface of the per-sample room.

The room holds the stages of one batch's way, each a subpackage (docs/architecture.md draws them):
``norms/`` the norm algebra, ``layers/`` the layer families and their registry, ``tracking/`` the batch
tracker and its operation rules, ``units/`` token privacy units, ``modes/`` how each mode computes
per-sample results, ``capture/`` the ``GradSampleHooks`` controller and what it delegates to.
Importing the package registers the built-in layer families (``layers``). Opacus' further names on
this path (``GradSampleModuleFastGradientClipping``, ...) live in ``dptorch.compat``.
"""

from dptorch.grad_sample import layers  # noqa: F401  (import registers the built-in layer families)
from dptorch.grad_sample.capture.hooks import GradSampleHooks
from dptorch.grad_sample.capture.wrapper import GradSampleModule
from dptorch.grad_sample.errors import PerSampleGradientError, UnsupportedModuleError
from dptorch.grad_sample.layers.checks import incompatibilities, register_module_check
from dptorch.grad_sample.layers.registry import find_grad_sampler, register_duck_grad_sampler, register_grad_sampler
from dptorch.grad_sample.tracking import register_batch_rule, remove_batch_rule

__all__ = [
    "GradSampleHooks",
    "GradSampleModule",
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
