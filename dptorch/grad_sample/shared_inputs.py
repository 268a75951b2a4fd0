"""Linear layers that read one input tensor (q/k/v, gate/up): their norms and clipped sums together.

Such layers share the input's Gram matrix for the norms and its clip-factor-scaled copy for the
clipped sums: one ``B T^2 d`` Gram, and one elementwise pass over the input, per group instead of
one per layer. Sharing is decided by memory identity (same storage, offset, shape, strides and
dtype), never by value; every kept input is alive until the round ends, so equal addresses mean
the same tensor. The algebra is ``linear_forms``'; which calls qualify is the strategy's choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.certified import wide_dtype
from dptorch.grad_sample.linear_forms import (
    at_least_float32,
    at_least_float32_dtype,
    certify_linear,
    flatten_middle_dims,
    gram_norms_sq,
    squared_norms,
)


def memory_key(t: torch.Tensor):
    """A key equal for two tensors exactly when they view the same memory the same way."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # tensor subclasses without a plain storage: identity only
        return ("id", id(t))
    return (t.device, t.dtype, ptr, t.storage_offset(), tuple(t.shape), t.stride())


@dataclass
class AffineUse:
    """One call of a Linear / Conv1D whose trainable weight and/or bias are wanted."""

    inputs: torch.Tensor  # (B, *middle, d)
    backprops: torch.Tensor  # (B, *middle, p)
    weight: Optional[nn.Parameter]
    bias: Optional[nn.Parameter]
    in_by_out: bool = False


def group_by_input(uses):
    """Lists of indices into ``uses`` whose inputs are the same memory, in first-seen order."""
    groups: Dict[object, list] = {}
    for index, use in enumerate(uses):
        groups.setdefault(memory_key(use.inputs), []).append(index)
    return list(groups.values())


def shared_affine_norms_sq(uses) -> list:
    """Squared per-sample norms ``{param: (B,)}`` for each use (see ``shared_affine_norms_and_grads``)."""
    return shared_affine_norms_and_grads(uses)[0]


def shared_affine_norms_and_grads(uses, sum_tokens: Optional[int] = None) -> Tuple[list, list]:
    """Squared per-sample norms ``{param: (B,)}`` for each use, with one input Gram per group, and
    the per-sample gradients that were instantiated on the way ``{param: (B, *shape)}``: every
    bias's (``B p`` numbers), and the weights' where instantiating was cheaper.

    Per group of uses reading the same ``a`` (``T`` tokens of ``d`` features), weight norms are
    ghost (``<a a^T, b_k b_k^T>``, float64 and certified: ``certify_linear``) or instantiated
    (``||b_k^T a||^2``, exact for the kept gradient the clipped sum then reads). Once the Gram is paid a
    ghost norm costs ``T^2 p_k`` against ``T d p_k`` instantiated, so the group goes ghost when
    ``T < d`` and ``sum_k (T d - T^2) p_k > T^2 d`` (for one use: the usual ``T (d + p) < d p``).
    An instantiated gradient (``B d p`` numbers, no more than the ``B T (d + p)`` of ``a`` and
    ``b``) then gives the clipped sum as a weighted sum (``weighted_sum``) instead of a second
    ``T d p`` matmul per sample. ``sum_tokens``: the tokens a certified norm's clipped sum is counted
    for, when more than the inputs' (``packed_affine``'s buckets are narrower than the longest unit).
    """
    results = [dict() for _ in uses]
    grads = [dict() for _ in uses]
    for group in group_by_input(uses):
        weighted = [i for i in group if uses[i].weight is not None]
        a = flatten_middle_dims(uses[group[0]].inputs)
        if weighted:
            a = at_least_float32(a)
        tokens, d = a.shape[1], a.shape[2]
        saving = sum((tokens * d - tokens * tokens) * uses[i].backprops.shape[-1] for i in weighted)
        ghost = tokens > 1 and tokens < d and saving > tokens * tokens * d
        # Norms not instantiated are formed in float64 and certified (their clipped sum is a matmul).
        wide = wide_dtype(a.device)
        a_wide = a.to(wide) if weighted and (ghost or tokens == 1) else None
        gram = torch.bmm(a_wide, a_wide.transpose(1, 2)) if ghost and weighted else None
        for i in group:
            use = uses[i]
            b = flatten_middle_dims(use.backprops)
            if use.weight is not None:
                dtype = torch.promote_types(a.dtype, at_least_float32_dtype(b.dtype))
                b = b.to(dtype)
                if a_wide is not None:
                    computed, terms = gram_norms_sq(a_wide, gram, b.to(wide))
                    results[i][use.weight] = certify_linear(computed, a, b, terms, wide, dtype, sum_tokens)
                else:
                    a_cast = a.to(dtype)
                    grad = torch.bmm(a_cast.transpose(1, 2), b) if use.in_by_out else torch.bmm(b.transpose(1, 2), a_cast)
                    results[i][use.weight] = squared_norms(grad)
                    grads[i][use.weight] = grad
            if use.bias is not None:  # the per-sample bias gradient is the summed output gradient
                grads[i][use.bias] = b.sum(1, dtype=at_least_float32_dtype(b.dtype))
                results[i][use.bias] = squared_norms(grads[i][use.bias])
    return results, grads


def shared_affine_clipped_sums(uses, factors) -> list:
    """``sum_i f_i G_i`` for each use's weight and bias (``{param: tensor}`` per use).

    ``factors[k]`` is ``(weight_factor, bias_factor)`` for use ``k``: float32 ``(B,)`` tensors
    already multiplied by the call's scale, or None for a parameter not asked for. The factor is
    applied in float32 (or wider) to whichever side is narrower: the group's shared input, scaled
    once per factor and reused by every use of the group, or the use's own output gradient.
    Bias sums are ``f . sum_t b_t`` (no scaled copy of ``b``).
    """
    results = [dict() for _ in uses]
    for group in group_by_input(uses):
        a = flatten_middle_dims(uses[group[0]].inputs)  # upcast only where a factor is not applied to it
        d = a.shape[-1]
        # Output widths per weight factor in the group: scale a when that is the narrower side.
        widths: Dict[int, int] = {}
        for i in group:
            if uses[i].weight is not None and factors[i][0] is not None:
                key = id(factors[i][0])
                widths[key] = widths.get(key, 0) + uses[i].backprops.shape[-1]
        scaled_inputs: Dict[tuple, torch.Tensor] = {}
        for i in group:
            use = uses[i]
            weight_factor, bias_factor = factors[i]
            b = flatten_middle_dims(use.backprops)
            dtype = at_least_float32_dtype(torch.promote_types(a.dtype, b.dtype))
            if use.weight is not None and weight_factor is not None:
                key = id(weight_factor)
                # A bf16 operand times the float32 factor is upcast and scaled in one pass (the
                # product is formed in float32: the same numbers as upcasting first).
                factor = weight_factor.to(dtype).view(-1, 1, 1)
                if d <= widths[key]:
                    b_rows = b.reshape(-1, b.shape[-1]).to(dtype)
                    scaled = scaled_inputs.get((key, dtype))
                    if scaled is None:
                        scaled = torch.mul(a, factor).reshape(-1, d)
                        scaled_inputs[(key, dtype)] = scaled
                    summed = scaled.t() @ b_rows if use.in_by_out else b_rows.t() @ scaled
                else:
                    scaled_b = torch.mul(b, factor).reshape(-1, b.shape[-1])
                    rows = a.reshape(-1, d).to(dtype)
                    summed = rows.t() @ scaled_b if use.in_by_out else scaled_b.t() @ rows
                results[i][use.weight] = summed.float()
            if use.bias is not None and bias_factor is not None:
                per_sample = b.sum(1, dtype=dtype)
                results[i][use.bias] = (bias_factor.to(dtype) @ per_sample).float()
    return results
