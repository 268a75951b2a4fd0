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
from dptorch.compat.opacus import grad_sample as _package
from dptorch.compat.opacus.grad_sample import *  # noqa: F403  (the wrapper classes Opacus reaches from here)

__all__ = sorted(_package.__all__ + ["get_hooks_class", "prepare_module", "register_grad_sampler"])
__getattr__ = unmapped_names(__name__, GRAD_SAMPLE_UNMAPPED)
