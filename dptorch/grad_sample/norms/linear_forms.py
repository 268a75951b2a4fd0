"""Per-sample gradients of maps linear in their weight, held as factors: the Gram algebra.

For a layer that is linear in its weight, sample ``i``'s gradient is ``G_i = sum_t b_it a_it^T``.
Its squared norm is ``sum_{t,t'} (a_it . a_it')(b_it . b_it')`` (the "ghost" form, cost about
``B T^2 (d + p)``) or, instantiated, ``||einsum(b, a)||^2`` (cost ``B T d p``); the layer families
pick the cheaper per call ("mixed ghost clipping"). This module owns what they share: the
``LinearForm`` of a gradient kept as its factors and the inner products of two such forms, the Gram
sums and their certification (``certified``), and the shape and dtype helpers (norms and clipped
sums are formed in float32 at least: bf16 activations and output gradients are upcast, so clip
factors are never rounded to bf16 and nothing is accumulated in it). It imports no layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dptorch.grad_sample.norms.certified import certified_norms_sq, gamma, magnitudes
from dptorch.grad_sample.norms.exact_products import (
    CertifiedProduct,
    certified_gram,
    certified_product,
    frobenius_bounds,
    frobenius_upper,
    operands,
    square_norm_upper,
)

#: Roundings a term of a clipped sum undergoes besides its own tokens' summation: the factor times
#: the call's scale, the factor's cast, its product with ``a`` or ``b``, and the product ``b a``.
CLIP_ROUNDINGS = 4

#: Tensors of one shape that hold at most this many elements together are computed in one call
#: (``weighted_sums``, ``shared_inputs.stacks``): at such sizes a step's time is its number of torch
#: calls, not their arithmetic (the blocks of a narrow model). Larger ones run alone: nothing is copied.
STACK_LIMIT = 1 << 18

#: Float64 copies made for certified norms hold at most this many elements (16 MiB) at a time: larger
#: operands are taken a block of samples at a time (``shared_inputs``), not copied whole.
WIDE_BLOCK = 1 << 21

#: Per-sample results a clipped sum holds at once (``token_sums``, 256 KiB in float32, within a core's cache): a
#: layer with more numbers takes one sample at a time, which in place measured as fast as one matmul over the
#: batch (B 16, T 128, widths 256 to 5000; larger blocks, 1-16 MiB, took up to 1.45x as long).
SUM_BLOCK = 1 << 16


def flatten_middle_dims(tensor: torch.Tensor) -> torch.Tensor:
    """View ``(B, *middle, F)`` as ``(B, prod(middle), F)``; works for ``B == 0`` and no middle dims."""
    if tensor.dim() == 3:
        return tensor
    middle = math.prod(tensor.shape[1:-1])
    return tensor.reshape(tensor.shape[0], middle, tensor.shape[-1])


def flatten_per_sample(tensor: torch.Tensor) -> torch.Tensor:
    """View ``(B, *rest)`` as ``(B, prod(rest))``: ``(B, 1)`` for a 0-d parameter's, and for ``B == 0`` too."""
    return tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:]))


def at_least_float32_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or in its own dtype if that is wider (float64); integer tensors unchanged.
    A float32 tensor is returned as is (no copy)."""
    if not t.is_floating_point():
        return t
    return t.to(at_least_float32_dtype(t.dtype))


@dataclass
class LinearForm:
    """A per-sample weight gradient ``G_i = sum_t left_it (x) right_it`` kept as its factors.

    ``left`` is ``(B, T, rows)``, or ``(B, T)`` integer indices standing for one-hot rows
    (embeddings); ``right`` is ``(B, T, cols)``.
    """

    left: torch.Tensor
    right: torch.Tensor

    @property
    def indexed(self) -> bool:
        return not self.left.is_floating_point()


    @property
    def tokens(self) -> int:
        return self.left.shape[1]

    @property
    def width(self) -> int:
        """Features of both factors (one for an index): the length of the Gram dot products."""
        return (1 if self.indexed else self.left.shape[-1]) + self.right.shape[-1]

    def magnitudes(self) -> torch.Tensor:
        """``sum_t ||left_t|| ||right_t||`` per sample (a one-hot row has norm 1): see ``certified``."""
        return magnitudes(None if self.indexed else self.left, self.right)


def _left_gram(x: LinearForm, y: LinearForm) -> CertifiedProduct:
    """``(left_x[t] . left_y[t'])`` for each sample: ``(B, T_x, T_y)``, certified (exact for one-hot rows)."""
    if x.indexed and y.indexed:
        ones = torch.ones(x.left.shape, dtype=torch.float64, device=x.left.device)
        return CertifiedProduct((x.left.unsqueeze(2) == y.left.unsqueeze(1)).to(torch.float64), (), ones, ones)
    if x.indexed:
        gram = _left_gram(y, x)
        return CertifiedProduct(gram.value.transpose(1, 2), tuple((v, u) for u, v in gram.bounds), gram.cols, gram.rows)
    if y.indexed:  # one-hot rows pick columns of the dense factor: exact
        index = y.left.unsqueeze(1).expand(-1, x.left.shape[1], -1)
        rows = torch.linalg.vector_norm(x.left, dim=2, dtype=torch.float64) * (1 + gamma(x.left.shape[2] + 2, torch.float64))
        ones = torch.ones(y.left.shape, dtype=torch.float64, device=y.left.device)
        return CertifiedProduct(x.left.to(torch.float64).gather(2, index), (), rows, ones)
    return certified_product(x.left, y.left.transpose(1, 2))


def form_inner_products_bounds(x: LinearForm, y: LinearForm) -> Tuple[torch.Tensor, torch.Tensor]:
    """``<G_i, H_i>`` (Frobenius) for each sample from the factors alone, certified: ``(computed, bound)``
    (``exact_products.frobenius_bounds``)."""
    return frobenius_bounds(_left_gram(x, y), certified_product(x.right, y.right.transpose(1, 2)))


def form_inner_products(x: LinearForm, y: LinearForm, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``<G_i, H_i>`` (Frobenius) for each sample, from the factors alone, computed in ``dtype`` (uncertified)."""
    if x.indexed or y.indexed:
        left = _left_gram(x, y).value.to(dtype)
    else:
        left = torch.bmm(x.left.to(dtype), y.left.to(dtype).transpose(1, 2))
    right = torch.bmm(x.right.to(dtype), y.right.to(dtype).transpose(1, 2))
    return frobenius_per_sample(left, right)


def shared_form_norms(uses, samples: Optional[int] = None) -> torch.Tensor:
    """Certified per-sample norm of ``sum_k s_k G_k`` from each use's scale ``s_k`` and ``LinearForm``.

    ``||sum_k s_k G_k||^2 = sum_{k,l} s_k s_l <G_k, G_l>``: the cross terms can cancel, so each is
    certified (``exact_products``: the value of ``<G_k, G_l>`` with a bound on its error, which for a
    cross term enters with its sign's worst case) and the clipped sum's rounding is certified with the
    magnitude ``sum_k |s_k| M_k`` (``certified``). Each use's clipped sum holds the sample's share of that use,
    which the other uses may cancel, while the other ``samples`` samples' sums are added to it (``token_sums``:
    ``samples``, default the forms' batch, is the batch the clipped sum adds); then the uses' sums are added (one
    more rounding per use). Float32, shape ``(B,)``.
    """
    sum_dtype = at_least_float32_dtype(uses[0][1].right.dtype)  # the dtype of the clipped sum: the factors' own
    for _, form in uses:
        if not form.indexed:
            sum_dtype = torch.promote_types(sum_dtype, form.left.dtype)
    # Each factor is cast once (``operands``), whatever the number of pairs it enters.
    cast = {id(f): LinearForm(*operands(f.left, f.right)) for _, f in uses}
    uses = [(scale, cast[id(form)]) for scale, form in uses]
    forms = [form for _, form in uses]
    f64 = torch.float64
    total = spread = 0
    for k, (scale_k, form_k) in enumerate(uses):
        for scale_l, form_l in uses[k:]:
            weight = scale_k * scale_l * (1.0 if form_l is form_k else 2.0)
            computed, bound = form_inner_products_bounds(form_k, form_l)
            total = total + (weight * computed + abs(weight) * bound)
            spread = spread + abs(weight) * (computed.abs() + bound)
    pairs = len(uses) * (len(uses) + 1) // 2
    total = (total + gamma(2 * pairs + 2, f64) * spread).clamp(min=0) * (1 + gamma(2, f64))
    tokens = max(form.tokens for form in forms)
    magnitude = sum(abs(scale) * form.magnitudes() for scale, form in uses)
    samples = max(form.right.shape[0] for form in forms) if samples is None else samples
    squared = certified_norms_sq(total, magnitude, sum_terms=tokens + samples + CLIP_ROUNDINGS + len(uses),
                                 sum_dtype=sum_dtype)
    return squared.sqrt().float()


def frobenius_per_sample(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sum_{t,s} x[b,t,s] y[b,t,s]`` for each ``b``: one fused dot product per sample (the einsum
    ``"bts,bts->b"`` becomes a batched matrix-vector product that ran 40x slower on CPU)."""
    return torch.linalg.vecdot(x.flatten(1), y.flatten(1))


def linear_norms_upper(a: torch.Tensor, b: torch.Tensor, a_gram: Optional[CertifiedProduct] = None) -> torch.Tensor:
    """An upper bound on ``||sum_t b_t a_t^T||^2`` per sample (float64, ``exact_products``): the Gram sum
    ``<a a^T, b b^T>`` (``a_gram``: ``a``'s certified Gram, where already formed), or the product of the two
    norms for one token (non-negative: no cancellation)."""
    if a.shape[1] == 1:
        norms = torch.linalg.vector_norm(a.flatten(1), dim=1, dtype=torch.float64)
        norms = norms * torch.linalg.vector_norm(b.flatten(1), dim=1, dtype=torch.float64)
        return norms.square() * (1 + gamma(a.shape[2] + b.shape[2] + 8, torch.float64))
    return frobenius_upper(certified_gram(a) if a_gram is None else a_gram, certified_gram(b))


def instantiated_norms_upper(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An upper bound on ``||b^T a||^2`` per sample from the certified instantiated product."""
    return square_norm_upper(certified_product(b.transpose(1, 2), a))


def certify_linear(computed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, norm_terms: int = 0,
                   norm_dtype: Optional[torch.dtype] = None,
                   sum_dtype: Optional[torch.dtype] = None, sum_tokens: Optional[int] = None,
                   magnitude: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``certified_norms_sq`` of ``sum_t b_t a_t^T`` (``a=None``: a bias) whose clipped sum is a
    matmul over the tokens in ``sum_dtype`` (default: float32 or the factors' wider dtype);
    ``sum_tokens`` (default: ``b``'s tokens) is what the clipped sum's roundings are counted for;
    ``magnitude``: ``magnitudes(a, b)``, where already formed. ``norm_terms=0``: ``computed`` is
    already an upper bound (``linear_norms_upper``)."""
    if sum_dtype is None:
        sum_dtype = at_least_float32_dtype(b.dtype if a is None else torch.promote_types(a.dtype, b.dtype))
    return certified_norms_sq(
        computed, magnitudes(a, b) if magnitude is None else magnitude, norm_terms=norm_terms, norm_dtype=norm_dtype,
        sum_terms=max(b.shape[1], sum_tokens or 0) + CLIP_ROUNDINGS, sum_dtype=sum_dtype,
    )


def token_sums(left: torch.Tensor, right: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``sum_i left_i^T right_i`` for ``left`` ``(*S, B, T, m)`` and ``right`` ``(*S, B, T, n)`` (``S``: at most one
    stack dim): ``(*S, m, n)``, each sample's tokens summed on their own before the samples are added.

    A clipped sum is certified for the roundings of its own sample's tokens (``certified``: ``gamma_m M`` with
    ``m`` about ``T``). One matmul over all ``B T`` rows would let a term of one sample pass through the additions
    of any other's (a BLAS kernel sums in blocks of its own choosing): a record whose tokens cancel (``K u`` and
    ``-K u``) then carries the rounding of everything added beside its ``K u``, ``B T u cK`` instead of ``T u cK``.
    Here each sample's sum is a matmul of its ``T`` tokens alone, and the finished per-sample sums are then
    added, each passing at most ``B`` more additions: for a weight's only use a finished sum is at most ``C``
    (a relative rounding, as in every mode), and a weight's several uses count those ``B``
    (``shared_form_norms``), which holds only if a unit's share is formed alone, in fresh memory, before it is
    added. ``in_place`` (a weight's only use): each sample's matmul accumulates into the running total (the
    total is one more term of the sample's sum, ``T + 1`` terms: as fast as one matmul over the batch, where
    fresh memory costs an extra pass). One token a sample (``T == 1``) cannot cancel within the sample: one
    matmul over the batch. Samples are taken ``SUM_BLOCK`` numbers of results at a time."""
    tokens = left.shape[-2]
    if tokens <= 1:
        return left.flatten(-3, -2).transpose(-1, -2) @ right.flatten(-3, -2)
    batch = left.shape[-3]
    per = max(1, SUM_BLOCK // max(1, math.prod(left.shape[:-3]) * left.shape[-1] * right.shape[-1]))
    total = part = None
    for start in range(0, batch, per):
        lhs, rhs = left[..., start:start + per, :, :].transpose(-1, -2), right[..., start:start + per, :, :]
        if per > 1:
            part = (lhs @ rhs).sum(-3)
        elif in_place and total is not None:
            lhs, rhs = lhs.squeeze(-3), rhs.squeeze(-3)
            total.addmm_(lhs, rhs) if total.dim() == 2 else total.baddbmm_(lhs, rhs)
            continue
        else:  # one sample into a reused buffer, then added
            part = torch.matmul(lhs.squeeze(-3), rhs.squeeze(-3), out=part)
        total = part.clone() if total is None else total.add_(part)
    if total is None:  # no sample
        total = left.new_zeros(*left.shape[:-3], left.shape[-1], right.shape[-1])
    return total


def run_sums(left: torch.Tensor, right: torch.Tensor, lengths) -> torch.Tensor:
    """``sum_r left_r^T right_r`` over consecutive runs of rows of ``left`` ``(N, m)`` and ``right`` ``(N, n)``, of
    ``lengths`` rows each (a sample's rows, as ``token_sums``' tokens): ``(m, n)``, each run summed on its own."""
    total = left.new_zeros(left.shape[1], right.shape[1])
    part, start = None, 0
    for length in lengths:  # each run into a reused buffer, then added (``token_sums``)
        if length:
            part = torch.mm(left[start:start + length].t(), right[start:start + length], out=part)
            total.add_(part)
        start += length
    return total


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """``||x_i||^2`` for each row ``i`` of a batch, in one fused reduction."""
    return torch.linalg.vector_norm(x.flatten(1), dim=1).square()


def weighted_sum(factor: torch.Tensor, per_sample: torch.Tensor) -> torch.Tensor:
    """``sum_i factor_i per_sample_i`` in float32 (or wider): one pass over the per-sample tensor."""
    dtype = at_least_float32_dtype(per_sample.dtype)
    return (factor.to(dtype) @ flatten_per_sample(per_sample.to(dtype))).view(per_sample.shape[1:])


def weighted_sums(pairs) -> list:
    """``weighted_sum(factor, per_sample)`` for each pair; small per-sample tensors of one shape and
    dtype that share a factor (the same tensor) are summed by one batched matmul (``stacked_map``)."""
    out: list = [None] * len(pairs)
    by_factor: dict = {}
    for i, (factor, _) in enumerate(pairs):
        by_factor.setdefault(id(factor), (factor, []))[1].append(i)
    for factor, indices in by_factor.values():
        def summed(stack: torch.Tensor, factor: torch.Tensor = factor) -> torch.Tensor:
            dtype = at_least_float32_dtype(stack.dtype)
            return factor.to(dtype) @ flatten_stacked(stack).to(dtype)
        for i, value in zip(indices, stacked_map(summed, [pairs[i][1] for i in indices])):
            shape = pairs[i][1].shape[1:]
            out[i] = value if value.shape == shape else value.view(shape)
    return out


def flatten_stacked(stack: torch.Tensor) -> torch.Tensor:
    """View a stack ``(n, B, *rest)`` of per-sample tensors as ``(n, B, prod(rest))``."""
    return stack.reshape(stack.shape[0], stack.shape[1], math.prod(stack.shape[2:]))


def stacked_map(fn, tensors) -> list:
    """``fn(stack)[j]`` for each tensor, where ``fn`` maps a stack ``(n, *shape)`` slice by slice:
    tensors of one shape, dtype and device holding at most ``STACK_LIMIT`` elements together share
    one stack, and so one call of each operation ``fn`` issues; a larger one is a stack of one (a view)."""
    out: list = [None] * len(tensors)
    runs: dict = {}
    for i, t in enumerate(tensors):
        key = (t.shape, t.dtype, t.device)
        held = runs.setdefault(key, [[]])
        if held[-1] and (len(held[-1]) + 1) * t.numel() > STACK_LIMIT:
            held.append([])
        held[-1].append(i)
    for held in runs.values():
        for run in held:
            stack = tensors[run[0]].unsqueeze(0) if len(run) == 1 else torch.stack([tensors[i] for i in run])
            for i, value in zip(run, fn(stack).unbind(0)):
                out[i] = value
    return out
