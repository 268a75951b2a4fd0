"""Per-sample gradients of ``nn.Linear`` (and the shared math for linear maps over features)."""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.registry import register_grad_sampler


def flatten_middle_dims(tensor: torch.Tensor) -> torch.Tensor:
    """View ``(B, *middle, F)`` as ``(B, prod(middle), F)``; works for ``B == 0`` and no middle dims."""
    middle = math.prod(tensor.shape[1:-1])
    return tensor.reshape(tensor.shape[0], middle, tensor.shape[-1])


def flatten_per_sample(tensor: torch.Tensor) -> torch.Tensor:
    """View ``(B, *rest)`` as ``(B, prod(rest))``: ``(B, 1)`` for a 0-d parameter's, and for ``B == 0`` too."""
    return tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:]))


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
