"""``opacus.grad_sample.utils``: wrap_model, prepare_module, get_gsm_class (see dptorch.compat.opacus), and the
wrapper classes Opacus reaches from there."""

from dptorch.compat.opacus import (
    GRAD_SAMPLE_UNMAPPED,
    get_gsm_class,
    get_hooks_class,
    prepare_module,
    register_grad_sampler,
    unmapped_names,
    wrap_model,
)
from dptorch.compat.opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights
from dptorch.compat.opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)

__all__ = [
    "GradSampleHooksFastGradientClipping",
    "GradSampleModuleExpandedWeights",
    "GradSampleModuleFastGradientClipping",
    "get_gsm_class",
    "get_hooks_class",
    "prepare_module",
    "register_grad_sampler",
    "wrap_model",
]
__getattr__ = unmapped_names(__name__, GRAD_SAMPLE_UNMAPPED)
