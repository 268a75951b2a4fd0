"""``nn.Linear``: its per-sample gradients, norms, clipped sums and linear form (and the shared math
of linear maps over features, which HF ``Conv1D`` and the DP RNN cells reuse).

Norms are ghost or instantiated per call, whichever is cheaper (``linear_forms``), formed as
certified products (``exact_products``); the clipped sum is the ordinary weight gradient with each sample's output gradient
scaled by its clip factor (book-keeping: no second backward pass).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.norms.certified import magnitudes, wide_dtype
from dptorch.grad_sample.norms.exact_products import operands
from dptorch.grad_sample.norms.linear_forms import (
    LinearForm,
    at_least_float32,
    certify_linear,
    flatten_middle_dims,
    instantiated_norms_upper,
    linear_norms_upper,
    squared_norms,
    token_sums,
)
from dptorch.grad_sample.layers.registry import register_grad_sampler, register_norm_sampler

Tensors = Tuple[torch.Tensor, ...]


def param_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape, also while DeepSpeed ZeRO-3 has it released (``data`` empty, the shape in ``ds_shape``)."""
    shape = getattr(param, "ds_shape", None)
    return torch.Size(shape) if shape is not None else param.shape


def common_dtype(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Cast the tensors to their promoted dtype (activations and backprops may differ under autocast)."""
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return tuple(tensor.to(dtype) for tensor in tensors)


def linear_map_grad_samples(
    weight: Optional[nn.Parameter],
    bias: Optional[nn.Parameter],
    inputs: torch.Tensor,
    backprops: torch.Tensor,
    weight_is_in_by_out: bool = False,
    empty: Optional[Callable[..., torch.Tensor]] = None,
    scale: float = 1.0,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample grads of ``y = x W^T + b`` applied to the last dim of ``(B, *middle, in)`` inputs.

    The weight grad of sample ``b`` is ``sum_m g[b, m] (outer) x[b, m]`` (shape ``(out, in)``), or its
    transpose when the weight is stored as ``(in, out)`` (``weight_is_in_by_out``); the bias grad is
    ``sum_m g[b, m]``. Frozen or missing parameters are skipped without any computation.
    ``empty(shape, dtype, device)``, if given, provides the memory of the weight grad (a
    ``BufferPool``'s), used when it is formed in the weight's dtype. ``scale`` multiplies both
    grads (the batch size of a mean loss); on the weight it rides in the matmul (no extra pass).
    """
    grads: Dict[nn.Parameter, torch.Tensor] = {}
    wants_weight = weight is not None and weight.requires_grad
    wants_bias = bias is not None and bias.requires_grad
    if not (wants_weight or wants_bias):
        return grads
    flat_backprops = flatten_middle_dims(backprops)
    if wants_weight:
        a, b = common_dtype(flatten_middle_dims(inputs), flat_backprops)
        left, right = (a.transpose(1, 2), b) if weight_is_in_by_out else (b.transpose(1, 2), a)
        shape = (a.shape[0], left.shape[1], right.shape[2])
        pooled = empty is not None and a.dtype == weight.dtype
        out = empty(shape, a.dtype, a.device) if pooled else a.new_empty(shape)
        # beta=0: the (uninitialised) memory is only written, never read
        grads[weight] = torch.baddbmm(out, left, right, beta=0, alpha=scale, out=out).to(weight.dtype)
    if wants_bias:
        summed = flat_backprops.sum(dim=1)
        grads[bias] = (summed.mul_(scale) if scale != 1.0 else summed).to(bias.dtype)
    return grads


def non_centred(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Random features ``(B, T, *rest)`` with a per-token shift and scale (probe inputs)."""
    scale = torch.randn(*shape[:2], *([1] * (len(shape) - 2)), generator=generator).exp()
    shift = torch.randn(*shape[:2], *([1] * (len(shape) - 2)), generator=generator)
    return torch.randn(*shape, generator=generator) * scale + 2 * shift


def linear_probe(module: nn.Linear, generator: torch.Generator) -> Tuple[torch.Tensor, ...]:
    """Two samples of three tokens of ``in_features`` each."""
    return (non_centred(generator, 2, 3, module.in_features),)


@register_grad_sampler(nn.Linear, probe=linear_probe)
def linear_grad_sampler(
    module: nn.Linear, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor, empty=None, scale=1.0
) -> Dict[nn.Parameter, torch.Tensor]:
    """``nn.Linear`` on inputs ``(B, *middle, in_features)``: one batched matmul over the middle dims."""
    return linear_map_grad_samples(module.weight, module.bias, activations[0], backprops, empty=empty, scale=scale)


# ----------------------------------------------------------------------------- norms and clipped sums


def affine_forms(module: nn.Module, inputs: torch.Tensor, backprops: torch.Tensor, in_by_out: bool) -> Dict[nn.Parameter, LinearForm]:
    """Weight ``sum_t b_t a_t^T`` (or its transpose) and bias ``sum_t b_t (x) 1``."""
    a, b = flatten_middle_dims(inputs), flatten_middle_dims(backprops)
    forms = {}
    if _trainable(module.weight):
        forms[module.weight] = LinearForm(a, b) if in_by_out else LinearForm(b, a)
    if _trainable(module.bias):
        forms[module.bias] = LinearForm(b, b.new_ones(b.shape[0], b.shape[1], 1))
    return forms


def _linear_form(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, LinearForm]:
    return affine_forms(module, activations[0], backprops, in_by_out=False)


def _trainable(param: Optional[nn.Parameter]) -> bool:
    return param is not None and param.requires_grad


def linear_weight_norms_sq(inputs: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """Certified squared norms of ``sum_t b_t a_t^T`` per sample (ghost or instantiated, whichever
    is cheaper, as certified products: ``exact_products``), for a clipped sum formed over the tokens
    (``linear_weight_sum``)."""
    a, b = flatten_middle_dims(inputs), flatten_middle_dims(backprops)
    tokens, d, p = a.shape[1], a.shape[2], b.shape[2]
    wide_a, wide_b = operands(a, b)  # cast once for the products and the magnitudes
    if tokens * (d + p) < d * p or tokens == 1:
        upper = linear_norms_upper(wide_a, wide_b)
    else:
        upper = instantiated_norms_upper(wide_a, wide_b)
    return certify_linear(upper, a, b, magnitude=magnitudes(wide_a, wide_b))


def linear_weight_sum(inputs: torch.Tensor, scaled_backprops: torch.Tensor) -> torch.Tensor:
    """``sum_i sum_t b_it a_it^T`` as ``(out, in)`` for ``(B, *middle, F)`` factors, each sample's tokens
    summed on their own first (``token_sums``: the rounding its certified norm counts).

    Both factors are upcast to float32 at least (bf16 activations included): the scaled backprops
    carry the clip factors, which a bf16 matmul would round (up as often as down).
    """
    dtype = torch.promote_types(torch.promote_types(inputs.dtype, scaled_backprops.dtype), torch.float32)
    return token_sums(flatten_middle_dims(scaled_backprops).to(dtype), flatten_middle_dims(inputs).to(dtype))


def linear_norms(weight, bias, inputs, backprops) -> Dict[nn.Parameter, torch.Tensor]:
    norms = {}
    if _trainable(weight):
        norms[weight] = linear_weight_norms_sq(inputs, backprops)
    if _trainable(bias):  # the clipped sum adds the scaled output gradients of every token
        b = flatten_middle_dims(backprops)
        wide = wide_dtype(b.device)
        norms[bias] = certify_linear(squared_norms(b.to(wide).sum(1)), None, b, b.shape[1] + b.shape[2] + 1, wide)
    return norms


def linear_sums(weight, bias, inputs, scaled_backprops, in_by_out=False) -> Dict[nn.Parameter, torch.Tensor]:
    sums = {}
    if _trainable(weight):
        w = linear_weight_sum(inputs, scaled_backprops)
        sums[weight] = (w.t() if in_by_out else w).float()
    if _trainable(bias):  # each sample's tokens first, as the weight's
        sums[bias] = at_least_float32(flatten_middle_dims(scaled_backprops)).sum(1).sum(0).float()
    return sums


def linear_clipped_sum(module: nn.Module, activations: Tensors, scaled_backprops: torch.Tensor):
    return linear_sums(module.weight, module.bias, activations[0], scaled_backprops)


@register_norm_sampler(nn.Linear, clipped_sum=linear_clipped_sum, token_wise=True, linear_form=_linear_form)
def linear_norm_sampler(module: nn.Module, activations: Tensors, backprops: torch.Tensor):
    """``nn.Linear``: ghost or instantiated norms per call, bias from the summed backprops."""
    return linear_norms(module.weight, module.bias, activations[0], backprops)
