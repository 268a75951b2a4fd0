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

from dptorch.grad_sample.norms.certified import magnitudes
from dptorch.grad_sample.norms.exact_products import certified_gram, operands
from dptorch.grad_sample.norms.linear_forms import (
    STACK_LIMIT,
    WIDE_BLOCK,
    at_least_float32,
    at_least_float32_dtype,
    certify_linear,
    flatten_middle_dims,
    linear_norms_upper,
    squared_norms,
    token_sums,
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

    inputs: Optional[torch.Tensor]  # (B, *middle, d); None once released (``shared_affine_norms_and_grads``)
    backprops: Optional[torch.Tensor]  # (B, *middle, p)
    weight: Optional[nn.Parameter]
    bias: Optional[nn.Parameter]
    in_by_out: bool = False
    sole_use: bool = False  # the weight's only use this round: its clipped sum may accumulate in place (``token_sums``)


def group_by_input(uses):
    """Lists of indices into ``uses`` whose inputs are the same memory, in first-seen order."""
    groups: Dict[object, list] = {}
    for index, use in enumerate(uses):
        groups.setdefault(memory_key(use.inputs), []).append(index)
    return list(groups.values())


def shared_affine_norms_sq(uses) -> list:
    """Squared per-sample norms ``{param: (B,)}`` for each use (see ``shared_affine_norms_and_grads``)."""
    return shared_affine_norms_and_grads(uses)[0]


def shared_affine_norms_and_grads(uses, sum_tokens: Optional[int] = None, release: bool = False) -> Tuple[list, list]:
    """Squared per-sample norms ``{param: (B,)}`` for each use, with one input Gram per group, and
    the per-sample gradients that were instantiated on the way ``{param: (B, *shape)}``: every
    bias's (``B p`` numbers), and the weights' where their memory allows (``ghost_norms_chosen``).

    Per group of uses reading the same ``a`` (``T`` tokens of ``d`` features), weight norms are
    ghost (``<a a^T, b_k b_k^T>``, certified products: ``exact_products``) or instantiated
    (``||b_k^T a||^2`` in float32, exact for the kept gradient the clipped sum then reads: what is
    summed is what was measured). An instantiated gradient gives the clipped sum as a weighted sum of
    ``B d p`` numbers (``weighted_sum``) instead of the ``T d p`` matmul per sample a ghost norm's
    clipped sum costs, the same matmul that instantiated it. ``sum_tokens``: the tokens a certified norm's clipped sum is counted
    for, when more than the inputs' (``packed_affine``'s buckets are narrower than the longest unit).
    Small groups of one shape (the blocks of a deep narrow model) are computed as one: ``stacks``.
    ``release``: a use whose every parameter's gradient was kept lets go of its ``inputs`` and ``backprops``
    (sets them to None) once its group is done, so that, where the caller holds no other reference, the
    kept gradients take the factors' memory instead of adding to it.
    """
    results = [dict() for _ in uses]
    grads = [dict() for _ in uses]
    for stack in stacks(uses):
        first = [uses[i] for i in stack[0]]
        a = _rows_of(uses, [group[0] for group in stack], "inputs")
        parts = [(_rows_of(uses, [group[k] for group in stack], "backprops"), use) for k, use in enumerate(first)]
        for k, computed in enumerate(_group_norms(a, parts, sum_tokens)):
            for group, pieces in zip(stack, zip(*(_split(t, len(stack)) for t in computed))):
                use = uses[group[k]]
                weight_sq, weight_grad, bias_sq, bias_grad = pieces
                if weight_sq is not None:
                    results[group[k]][use.weight] = weight_sq
                if weight_grad is not None:
                    grads[group[k]][use.weight] = weight_grad
                if bias_sq is not None:
                    results[group[k]][use.bias] = bias_sq
                    grads[group[k]][use.bias] = bias_grad
        del a, parts  # this stack's factors: only the uses hold them now
        if release:
            for index in (i for group in stack for i in group):
                if all(p is None or p in grads[index] for p in (uses[index].weight, uses[index].bias)):
                    uses[index].inputs = uses[index].backprops = None
    return results, grads


#: How many times the numbers of a call's held factors (``a`` and ``b``: ``B T (d + p)``) its kept instantiated
#: weight gradients (``B d p``) may hold. Instantiating costs one ``T d p`` matmul per sample: what a ghost norm's
#: clipped sum costs anyway, so the instantiated route is always the faster one (no Grams, certified in float64
#: on CPU; the clipped sum a weighted sum of ``B d p`` numbers). Ghost norms save memory, so memory decides. At 1
#: a kept gradient takes no more memory than the factors it lets go of (``release``); at 2 the narrow shapes'
#: bk step through make_private took 0.7-0.9x its time at 1 on CPU, but the kept gradients, alive together
#: between the norms and the clipped sums, raised its peak RSS to 1.11-1.29x the plain step's
#: (docs/performance.md, "Memory through the engine"): memory first.
INSTANTIATED_MEMORY = 1


def ghost_norms_chosen(tokens: int, d: int, widths) -> bool:
    """Whether weights of output widths ``widths`` reading ``tokens`` tokens of ``d`` features form ghost norms (one
    input Gram, then ``T^2 p_k`` each) rather than instantiated gradients: when ``B d sum_k p_k`` kept numbers
    would exceed ``INSTANTIATED_MEMORY`` times the ``B T (d + sum_k p_k)`` of the held factors (see
    ``shared_affine_norms_and_grads``)."""
    width = sum(widths)
    return 1 < tokens and d * width > INSTANTIATED_MEMORY * tokens * (d + width)


def _group_norms(a: torch.Tensor, parts, sum_tokens: Optional[int]) -> list:
    """``(weight_sq, weight_grad, bias_sq, bias_grad)`` (None where not formed) for each ``(b, use)``
    of a group reading ``a`` (``(B, T, d)``; each ``b`` ``(B, T, p)``): see ``shared_affine_norms_and_grads``."""
    weighted = [use for _, use in parts if use.weight is not None]
    if weighted:
        a = at_least_float32(a)
    tokens, d = a.shape[1], a.shape[2]
    ghost = ghost_norms_chosen(tokens, d, [b.shape[-1] for b, use in parts if use.weight is not None])
    dtypes = [torch.promote_types(a.dtype, at_least_float32_dtype(b.dtype)) for b, _ in parts]
    parts = [(_as(b, dtype) if use.weight is not None else b, use) for (b, use), dtype in zip(parts, dtypes)]
    # Norms not instantiated are certified (their clipped sum is a matmul).
    certified = [(b, dtype) for (b, use), dtype in zip(parts, dtypes) if use.weight is not None] if ghost or tokens == 1 else []
    certified_sq = iter(_certified_weight_norms(a, certified, sum_tokens))
    out = []
    for (b, use), dtype in zip(parts, dtypes):
        weight_sq = weight_grad = bias_sq = bias_grad = None
        if use.weight is not None:
            if certified:
                weight_sq = next(certified_sq)
            else:
                a_cast = _as(a, dtype)
                weight_grad = torch.bmm(a_cast.transpose(1, 2), b) if use.in_by_out else torch.bmm(b.transpose(1, 2), a_cast)
                weight_sq = squared_norms(weight_grad)
        if use.bias is not None:  # the per-sample bias gradient is the summed output gradient
            bias_grad = b.sum(1, dtype=at_least_float32_dtype(b.dtype))
            bias_sq = squared_norms(bias_grad)
        out.append((weight_sq, weight_grad, bias_sq, bias_grad))
    return out


def _certified_weight_norms(a: torch.Tensor, parts, sum_tokens: Optional[int]) -> list:
    """Certified squared norms of ``sum_t b_t a_t^T`` for each ``(b, dtype of its clipped sum)`` in
    ``parts``, by the input Gram (``linear_norms_upper``: certified products, ``exact_products``),
    formed a block of samples at a time: no block's wide copies exceed ``WIDE_BLOCK`` elements (a
    ``(B, T, vocab)`` output gradient is never copied whole). The Gram sums and magnitudes are per
    sample, the certification then runs once on all."""
    if not parts:
        return []
    tokens = a.shape[1]
    rows = max(1, WIDE_BLOCK // max(1, tokens * max(a.shape[2], *(b.shape[2] for b, _ in parts))))
    blocks = []
    for start in range(0, max(a.shape[0], 1), rows):
        (a_block,) = operands(a[start:start + rows])
        gram = certified_gram(a_block) if tokens > 1 else None
        block = []
        for b, _ in parts:
            (b_block,) = operands(b[start:start + rows])
            block.append((linear_norms_upper(a_block, b_block, gram), magnitudes(a_block, b_block)))
        blocks.append(block)
    out = []
    for (b, dtype), column in zip(parts, zip(*blocks)):
        upper, magnitude = (torch.cat(x) if len(x) > 1 else x[0] for x in zip(*column))
        out.append(certify_linear(upper, a, b, sum_dtype=dtype, sum_tokens=sum_tokens, magnitude=magnitude))
    return out


def shared_affine_clipped_sums(uses, factors) -> list:
    """``sum_i f_i G_i`` for each use's weight and bias (``{param: tensor}`` per use).

    ``factors[k]`` is ``(weight_factor, bias_factor)`` for use ``k``: float32 ``(B,)`` tensors
    already multiplied by the call's scale, or None for a parameter not asked for. The factor is
    applied in float32 (or wider) to whichever side is narrower: the group's shared input, scaled
    once per factor and reused by every use of the group, or the use's own output gradient.
    Bias sums are ``f . sum_t b_t`` (no scaled copy of ``b``). The groups of a stack (``stacks``)
    are summed by one batched matmul, each group its own matrix.
    """
    results = [dict() for _ in uses]
    for stack in stacks(uses, factors):
        a = _stacked(uses, [group[0] for group in stack], "inputs")  # (n, B, T, d); upcast where no factor is applied
        d = a.shape[-1]
        # Output widths per stacked weight factor: scale a when that is the narrower side.
        keys = [tuple(id(factors[group[k]][0]) for group in stack) for k in range(len(stack[0]))]
        widths: Dict[tuple, int] = {}
        for k, i in enumerate(stack[0]):
            if uses[i].weight is not None and factors[i][0] is not None:
                widths[keys[k]] = widths.get(keys[k], 0) + uses[i].backprops.shape[-1]
        scaled_inputs: Dict[tuple, torch.Tensor] = {}
        for k, i in enumerate(stack[0]):
            use = uses[i]
            weight_factor, bias_factor = factors[i]
            b = _stacked(uses, [group[k] for group in stack], "backprops")  # (n, B, T, p)
            p = b.shape[-1]
            dtype = at_least_float32_dtype(torch.promote_types(a.dtype, b.dtype))
            summed = bias_sum = None
            if use.weight is not None and weight_factor is not None:
                # A bf16 operand times the float32 factor is upcast and scaled in one pass (the
                # product is formed in float32: the same numbers as upcasting first).
                factor = _stacked_factors(factors, stack, k, 0, dtype).view(len(stack), -1, 1, 1)
                # (n, B, T, *) factors: each sample's tokens summed on their own first (``token_sums``)
                in_place = all(uses[group[k]].sole_use for group in stack)
                if d <= widths[keys[k]]:
                    b_rows = _as(b, dtype)
                    scaled = scaled_inputs.get((keys[k], dtype))
                    if scaled is None:
                        scaled = torch.mul(a, factor)
                        scaled_inputs[(keys[k], dtype)] = scaled
                    summed = token_sums(scaled, b_rows, in_place) if use.in_by_out else token_sums(b_rows, scaled, in_place)
                else:
                    scaled_b = torch.mul(b, factor)
                    rows = _as(a, dtype)
                    summed = token_sums(rows, scaled_b, in_place) if use.in_by_out else token_sums(scaled_b, rows, in_place)
                summed = _as(summed, torch.float32)
            if use.bias is not None and bias_factor is not None:
                per_sample = b.sum(2, dtype=dtype)  # (n, B, p)
                bias_factor = _stacked_factors(factors, stack, k, 1, dtype).unsqueeze(1)
                bias_sum = _as(torch.bmm(bias_factor, per_sample).squeeze(1), torch.float32)
            weight_sums = (None,) * len(stack) if summed is None else summed.unbind(0)
            bias_sums = (None,) * len(stack) if bias_sum is None else bias_sum.unbind(0)
            for group, weight_sum, bias_total in zip(stack, weight_sums, bias_sums):
                if weight_sum is not None:
                    results[group[k]][uses[group[k]].weight] = weight_sum
                if bias_total is not None:
                    results[group[k]][uses[group[k]].bias] = bias_total
    return results


def stacks(uses, factors=None) -> list:
    """``group_by_input``'s groups in lists: groups of one signature (device, dtypes, shapes, which
    parameters and, with ``factors``, which factors) and small enough share a list, in first-seen
    order; every other group is a list of its own. Every computation on a stack is row by row or
    matrix by matrix, so a group's results are its own (rounding within each matrix aside)."""
    out: list = []
    open_stacks: Dict[tuple, list] = {}
    for group in group_by_input(uses):
        members = [uses[i] for i in group]
        a = members[0].inputs
        size = a.numel() + sum(u.backprops.numel() for u in members)
        if a.shape[0] == 0 or 2 * size > STACK_LIMIT:
            out.append([group])
            continue
        key = (a.device, a.dtype, tuple(a.shape), tuple(
            (tuple(u.backprops.shape), u.backprops.dtype, u.weight is not None, u.bias is not None, u.in_by_out)
            + (() if factors is None else tuple(None if f is None else f.dtype for f in factors[i]))
            for u, i in zip(members, group)
        ))
        stack = open_stacks.get(key)
        if stack is None or (len(stack) + 1) * size > STACK_LIMIT:
            stack = open_stacks[key] = []
            out.append(stack)
        stack.append(group)
    return out


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (itself when it is already: no call into torch)."""
    return t if t.dtype == dtype else t.to(dtype)


def _rows_of(uses, indices, field: str) -> torch.Tensor:
    """The uses' ``field`` tensors as ``(B, T, F)``, concatenated along the batch (one: itself)."""
    tensors = [flatten_middle_dims(getattr(uses[i], field)) for i in indices]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _split(t: Optional[torch.Tensor], parts: int) -> tuple:
    """``t``'s rows in ``parts`` equal blocks (Nones for None)."""
    if t is None:
        return (None,) * parts
    return (t,) if parts == 1 else t.chunk(parts)


def _stacked(uses, indices, field: str) -> torch.Tensor:
    """The uses' ``field`` tensors as ``(n, B, T, F)`` (one: a view of it)."""
    tensors = [flatten_middle_dims(getattr(uses[i], field)) for i in indices]
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _stacked_factors(factors, stack, k: int, which: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``which`` factor (0 weight, 1 bias) of position ``k`` of each group: ``(n, B)`` in ``dtype``."""
    tensors = [factors[group[k]][which] for group in stack]
    return _as(tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors), dtype)
