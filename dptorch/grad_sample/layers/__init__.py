"""The built-in layer families, one file each holding all of that layer's math: grad sampler and,
where the layer has them, norm sampler, clipped sum and linear form (linear, embedding, hf_conv1d,
conv, normalization, the expert banks of mixture-of-experts models: experts, and the LM head with its
cross-entropy computed block by block: chunked_lm_head). Importing this package registers
them; the package ``dptorch.grad_sample`` imports it.
"""

from torch import nn

from dptorch.grad_sample.layers import chunked_lm_head, conv, embedding, experts, hf_conv1d, linear, normalization  # noqa: F401  (import registers)


def reads_no_parameter_data(module: nn.Module) -> bool:
    """Whether ``module``'s grad and norm samplers read only its activations, output gradients and the parameters'
    ``requires_grad``, dtype and shape (by ``linear.param_shape``: ZeRO-3's ``ds_shape`` while released), so they are
    exact while ZeRO-3 has the parameters released (``data`` empty): ``nn.Linear`` (LoRA's adapters are ``nn.Linear``),
    ``nn.Embedding``, ``nn.LayerNorm`` (any ``normalized_shape``), ``nn.RMSNorm`` and the HF RMSNorm family
    (``LlamaRMSNorm``, ...)."""
    exact = (nn.Linear, nn.Embedding, nn.LayerNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
    return isinstance(module, exact) or normalization.looks_like_hf_rms_norm(module)



#: Built-in grad samplers that read only activations, output gradients, the module's plain attributes and its
#: parameters' ``requires_grad``, dtype and shape (never their data): those of ``nn.Linear``, HF's ``Conv1D``,
#: ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm`` and the HF RMSNorm family.
_SHAPE_ONLY_SAMPLERS = frozenset(
    {linear.linear_grad_sampler, hf_conv1d.hf_conv1d_grad_sampler, embedding.embedding_grad_sampler,
     normalization.layer_norm_grad_sampler, normalization.hf_rms_norm_grad_sampler}
    | ({normalization.rms_norm_grad_sampler} if hasattr(normalization, "rms_norm_grad_sampler") else set())
)


def samples_from_shapes_alone(sampler) -> bool:
    """Whether ``sampler`` is one of the built-in grad samplers that read no parameter data, so that one module
    of a configuration can sample the calls of others (``stacked_calls``). A sampler registered by the user is
    never assumed to be one, whatever its module's class."""
    return sampler in _SHAPE_ONLY_SAMPLERS
