"""The built-in layer families, one file each holding all of that layer's math: grad sampler and,
where the layer has them, norm sampler, clipped sum and linear form (linear, embedding, hf_conv1d,
conv, norms, and the expert banks of mixture-of-experts models: experts). Importing this package registers
them; the package ``dptorch.grad_sample`` imports it.
"""

from torch import nn

from dptorch.grad_sample.layers import conv, embedding, experts, hf_conv1d, linear, norms  # noqa: F401  (import registers)


def reads_no_parameter_data(module: nn.Module) -> bool:
    """Whether ``module``'s grad and norm samplers read only its activations, output gradients and the parameters'
    ``requires_grad``, dtype and shape (by ``linear.param_shape``: ZeRO-3's ``ds_shape`` while released), so they are
    exact while ZeRO-3 has the parameters released (``data`` empty): ``nn.Linear`` (LoRA's adapters are ``nn.Linear``),
    ``nn.Embedding``, ``nn.LayerNorm`` (any ``normalized_shape``), ``nn.RMSNorm`` and the HF RMSNorm family
    (``LlamaRMSNorm``, ...)."""
    exact = (nn.Linear, nn.Embedding, nn.LayerNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
    return isinstance(module, exact) or norms.looks_like_hf_rms_norm(module)


def samples_from_shapes_alone(module: nn.Module) -> bool:
    """Whether ``module``'s samplers read no parameter data, so that one module of a configuration can sample
    the calls of others (``stacked_calls``): ``reads_no_parameter_data``'s layers and HF's ``Conv1D``, whose
    rules are the Linear ones (it stays out of ``reads_no_parameter_data``, which also decides what ZeRO-3
    accepts, a setting where ``Conv1D`` is not tested)."""
    return reads_no_parameter_data(module) or hf_conv1d.looks_like_hf_conv1d(module)
