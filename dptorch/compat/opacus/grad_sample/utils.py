"""``opacus.grad_sample.utils``: wrap_model, prepare_module, get_gsm_class (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import (
    GRAD_SAMPLE_UNMAPPED,
    get_gsm_class,
    get_hooks_class,
    prepare_module,
    register_grad_sampler,
    unmapped_names,
    wrap_model,
)

__all__ = ["get_gsm_class", "get_hooks_class", "prepare_module", "register_grad_sampler", "wrap_model"]
__getattr__ = unmapped_names(__name__, GRAD_SAMPLE_UNMAPPED)
