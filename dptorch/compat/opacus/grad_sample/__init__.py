"""``opacus.grad_sample``: the package is :mod:`dptorch.grad_sample` itself; the Opacus names it does not
define are these, served on it by :mod:`dptorch.compat.paths` (``SHARED``). The submodules (``utils``,
``grad_sample_module``, ...) are Opacus' own paths."""

from dptorch.compat.opacus import get_gsm_class, wrap_model
from dptorch.compat.opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from dptorch.compat.opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights

__all__ = [
    "GradSampleHooksFastGradientClipping",
    "GradSampleModuleExpandedWeights",
    "GradSampleModuleFastGradientClipping",
    "get_gsm_class",
    "wrap_model",
]
