"""Per-sample gradient norms without per-sample gradients, and clipped sums from (a, b).

For a layer that is linear in its weight, sample ``i``'s gradient is ``G_i = sum_t b_it a_it^T``.
Its squared norm is ``sum_{t,t'} (a_it . a_it')(b_it . b_it')`` (the "ghost" form, cost about
``B T^2 (d + p)``) or, instantiated, ``||einsum(b, a)||^2`` (cost ``B T d p``); each call picks
the cheaper ("mixed ghost clipping"). The clipped sum ``sum_i c_i G_i`` is the ordinary weight
gradient with each sample's ``b`` scaled by ``c_i`` (book-keeping: no second backward pass).
Norms and clipped sums are computed in float32 at least: bf16 activations and output gradients
are upcast, so the clip factors are never rounded to bf16 and nothing is accumulated in it.
Every norm formed by a sum that can cancel (Gram sums, an embedding row's summed output gradients,
the cross terms of shared uses) is formed in float64 and certified (``certified``): it bounds the
norm of what the clipped sum adds for the sample, both roundings included.

A norm sampler is ``(module, activations, backprops) -> {param: squared norm per sample}``;
its clipped-sum partner takes backprops already scaled per sample and returns batch gradients.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from dataclasses import dataclass

from dptorch.grad_sample.certified import certified_norms_sq, gamma, magnitudes, wide_dtype
from dptorch.grad_sample.layers.embedding import RenormedEmbedding
from dptorch.grad_sample.layers.hf_conv1d import looks_like_hf_conv1d
from dptorch.grad_sample.layers.linear import flatten_middle_dims, flatten_per_sample
from dptorch.grad_sample.registry import register_norm_sampler

Tensors = Tuple[torch.Tensor, ...]
#: Roundings a term of a clipped sum undergoes besides its own tokens' summation: the factor times
#: the call's scale, the factor's cast, its product with ``a`` or ``b``, and the product ``b a``.
CLIP_ROUNDINGS = 4


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


def _left_gram(x: LinearForm, y: LinearForm, dtype: torch.dtype) -> torch.Tensor:
    """``(left_x[t] . left_y[t'])`` for each sample: ``(B, T_x, T_y)``."""
    if x.indexed and y.indexed:
        return (x.left.unsqueeze(2) == y.left.unsqueeze(1)).to(dtype)
    if x.indexed:
        return _left_gram(y, x, dtype).transpose(1, 2)
    if y.indexed:  # one-hot rows pick columns of the dense factor
        index = y.left.unsqueeze(1).expand(-1, x.left.shape[1], -1)
        return x.left.to(dtype).gather(2, index)
    return torch.bmm(x.left.to(dtype), y.left.to(dtype).transpose(1, 2))


def form_inner_products(x: LinearForm, y: LinearForm, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``<G_i, H_i>`` (Frobenius) for each sample, from the factors alone, computed in ``dtype``."""
    right = torch.bmm(x.right.to(dtype), y.right.to(dtype).transpose(1, 2))
    return frobenius_per_sample(_left_gram(x, y, dtype), right)


def shared_form_norms(uses) -> torch.Tensor:
    """Certified per-sample norm of ``sum_k s_k G_k`` from each use's scale ``s_k`` and ``LinearForm``.

    ``||sum_k s_k G_k||^2 = sum_{k,l} s_k s_l <G_k, G_l>``: the cross terms can cancel, so the sum
    is formed in float64 and certified with the magnitude ``sum_k |s_k| M_k`` (``certified``); the
    clipped sum adds the uses' sums (one more rounding per use). Float32, shape ``(B,)``.
    """
    dtype = wide_dtype(uses[0][1].right.device)
    forms = [form for _, form in uses]
    # Each factor is cast to the wide dtype once, whatever the number of pairs it enters.
    wide = {id(f): LinearForm(f.left if f.indexed else f.left.to(dtype), f.right.to(dtype)) for f in forms}
    total = None
    for k, (scale_k, form_k) in enumerate(uses):
        for scale_l, form_l in uses[k:]:
            weight = scale_k * scale_l * (1.0 if form_l is form_k else 2.0)
            term = weight * form_inner_products(wide[id(form_k)], wide[id(form_l)], dtype)
            total = term if total is None else total + term
    tokens = max(form.tokens for form in forms)
    magnitude = sum(abs(scale) * wide[id(form)].magnitudes() for scale, form in uses)
    sum_dtype = at_least_float32_dtype(forms[0].right.dtype)
    for form in forms:
        if not form.indexed:
            sum_dtype = torch.promote_types(sum_dtype, form.left.dtype)
    squared = certified_norms_sq(
        total, magnitude,
        norm_terms=max(form.width for form in forms) + tokens * tokens + len(uses) ** 2 + 4, norm_dtype=dtype,
        sum_terms=tokens + CLIP_ROUNDINGS + len(uses), sum_dtype=sum_dtype,
    )
    return squared.sqrt().float()


def frobenius_per_sample(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sum_{t,s} x[b,t,s] y[b,t,s]`` for each ``b``: one fused dot product per sample (the einsum
    ``"bts,bts->b"`` becomes a batched matrix-vector product that ran 40x slower on CPU)."""
    return torch.linalg.vecdot(x.flatten(1), y.flatten(1))


def _affine_forms(module: nn.Module, inputs: torch.Tensor, backprops: torch.Tensor, in_by_out: bool) -> Dict[nn.Parameter, LinearForm]:
    """Weight ``sum_t b_t a_t^T`` (or its transpose) and bias ``sum_t b_t (x) 1``."""
    a, b = flatten_middle_dims(inputs), flatten_middle_dims(backprops)
    forms = {}
    if _trainable(module.weight):
        forms[module.weight] = LinearForm(a, b) if in_by_out else LinearForm(b, a)
    if _trainable(module.bias):
        forms[module.bias] = LinearForm(b, b.new_ones(b.shape[0], b.shape[1], 1))
    return forms


def _linear_form(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, LinearForm]:
    return _affine_forms(module, activations[0], backprops, in_by_out=False)


def _hf_conv1d_form(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, LinearForm]:
    return _affine_forms(module, activations[0], backprops, in_by_out=True)


def _embedding_form(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, LinearForm]:
    if not module.weight.requires_grad:
        return {}
    ids = activations[0].reshape(activations[0].shape[0], math.prod(activations[0].shape[1:]))
    right = backprops.reshape(ids.shape[0], ids.shape[1], backprops.shape[-1])
    if module.padding_idx is not None:  # the padding row gets no gradient
        right = right * (ids != module.padding_idx).unsqueeze(-1)
    return {module.weight: LinearForm(ids, right)}


def _trainable(param: Optional[nn.Parameter]) -> bool:
    return param is not None and param.requires_grad


def linear_weight_norms_sq(inputs: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """Certified squared norms of ``sum_t b_t a_t^T`` per sample (ghost or instantiated, whichever
    is cheaper, in float64), for a clipped sum formed over the tokens (``linear_weight_sum``)."""
    a, b = flatten_middle_dims(inputs), flatten_middle_dims(backprops)
    wide = wide_dtype(a.device)
    a64, b64 = a.to(wide), b.to(wide)
    tokens, d, p = a.shape[1], a.shape[2], b.shape[2]
    if tokens * (d + p) < d * p or tokens == 1:
        gram = torch.bmm(a64, a64.transpose(1, 2)) if tokens > 1 else None
        computed, terms = gram_norms_sq(a64, gram, b64)
    else:
        computed, terms = squared_norms(torch.bmm(b64.transpose(1, 2), a64)), 2 * tokens + d * p + 1
    return certify_linear(computed, a, b, terms, wide)


def gram_norms_sq(a: torch.Tensor, gram: Optional[torch.Tensor], b: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``sum_{t,s} gram[t,s] (b_t . b_s)`` (``||a||^2 ||b||^2`` for one token, where ``gram`` may be
    None) in the dtype of ``b``, and the roundings of each of its terms (for ``certified_norms_sq``)."""
    tokens, d, p = a.shape[1], a.shape[2], b.shape[2]
    if tokens == 1:
        return squared_norms(a).to(b.dtype) * squared_norms(b), d + p + 1
    return frobenius_per_sample(gram.to(b.dtype), torch.bmm(b, b.transpose(1, 2))), d + p + 1 + tokens * tokens


def certify_linear(computed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, norm_terms: int, norm_dtype: torch.dtype,
                   sum_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``certified_norms_sq`` of ``sum_t b_t a_t^T`` (``a=None``: a bias) whose clipped sum is a
    matmul over the tokens in ``sum_dtype`` (default: float32 or the factors' wider dtype)."""
    if sum_dtype is None:
        sum_dtype = at_least_float32_dtype(b.dtype if a is None else torch.promote_types(a.dtype, b.dtype))
    return certified_norms_sq(
        computed, magnitudes(a, b), norm_terms=norm_terms, norm_dtype=norm_dtype,
        sum_terms=b.shape[1] + CLIP_ROUNDINGS, sum_dtype=sum_dtype,
    )


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """``||x_i||^2`` for each row ``i`` of a batch, in one fused reduction."""
    return torch.linalg.vector_norm(x.flatten(1), dim=1).square()


def linear_weight_sum(inputs: torch.Tensor, scaled_backprops: torch.Tensor) -> torch.Tensor:
    """``sum_i sum_t b_it a_it^T`` as ``(out, in)``: one matmul over all tokens of the batch.

    Both factors are upcast to float32 at least (bf16 activations included): the scaled backprops
    carry the clip factors, which a bf16 matmul would round (up as often as down).
    """
    dtype = torch.promote_types(torch.promote_types(inputs.dtype, scaled_backprops.dtype), torch.float32)
    a = inputs.reshape(-1, inputs.shape[-1]).to(dtype)
    b = scaled_backprops.reshape(-1, scaled_backprops.shape[-1]).to(dtype)
    return b.t() @ a


def _linear_norms(weight, bias, inputs, backprops) -> Dict[nn.Parameter, torch.Tensor]:
    norms = {}
    if _trainable(weight):
        norms[weight] = linear_weight_norms_sq(inputs, backprops)
    if _trainable(bias):  # the clipped sum adds the scaled output gradients of every token
        b = flatten_middle_dims(backprops)
        wide = wide_dtype(b.device)
        norms[bias] = certify_linear(squared_norms(b.to(wide).sum(1)), None, b, b.shape[1] + b.shape[2] + 1, wide)
    return norms


def _linear_sums(weight, bias, inputs, scaled_backprops, in_by_out=False) -> Dict[nn.Parameter, torch.Tensor]:
    sums = {}
    if _trainable(weight):
        w = linear_weight_sum(inputs, scaled_backprops)
        sums[weight] = (w.t() if in_by_out else w).float()
    if _trainable(bias):
        sums[bias] = _at_least_float32(scaled_backprops).reshape(-1, scaled_backprops.shape[-1]).sum(0).float()
    return sums


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _linear_clipped_sum(module: nn.Module, activations: Tensors, scaled_backprops: torch.Tensor):
    return _linear_sums(module.weight, module.bias, activations[0], scaled_backprops)


def _hf_conv1d_clipped_sum(module: nn.Module, activations: Tensors, scaled_backprops: torch.Tensor):
    return _linear_sums(module.weight, module.bias, activations[0], scaled_backprops, in_by_out=True)


@register_norm_sampler(nn.Linear, clipped_sum=_linear_clipped_sum, token_wise=True, linear_form=_linear_form)
def linear_norm_sampler(module: nn.Module, activations: Tensors, backprops: torch.Tensor):
    """``nn.Linear``: ghost or instantiated norms per call, bias from the summed backprops."""
    return _linear_norms(module.weight, module.bias, activations[0], backprops)


@register_norm_sampler(predicate=looks_like_hf_conv1d, clipped_sum=_hf_conv1d_clipped_sum, token_wise=True, linear_form=_hf_conv1d_form)
def hf_conv1d_norm_sampler(module: nn.Module, activations: Tensors, backprops: torch.Tensor):
    """transformers' ``Conv1D``: the same norms as a Linear layer (the layout does not matter)."""
    return _linear_norms(module.weight, module.bias, activations[0], backprops)


def _embedding_clipped_sum(module: nn.Module, activations: Tensors, scaled_backprops: torch.Tensor):
    weight = module.weight
    if not weight.requires_grad:
        return {}
    ids = activations[0].reshape(-1)
    values = _at_least_float32(scaled_backprops.reshape(ids.shape[0], scaled_backprops.shape[-1]))
    summed = values.new_zeros(weight.shape).index_add_(0, ids, values)
    if module.padding_idx is not None:
        summed[module.padding_idx] = 0
    return {weight: summed.float()}


def _not_scaled_by_frequency(module: nn.Module) -> bool:
    return not module.scale_grad_by_freq


def embedding_norms_sq_by_rows(indices: torch.Tensor, backprops: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
    """Certified per-sample squared norms from the rows each sample touches: ``sum_v ||sum_{t: x_t = v} b_t||^2``.

    Only the (sample, row) pairs that occur are formed, so the cost is about ``B T d`` whatever
    the vocabulary size, against ``B V d`` for the instantiated gradient. A row's output gradients
    can cancel over its repeated ids: the rows are summed in float64 and the result is certified
    (``certified``) with the magnitude ``sqrt(sum_v (sum_{t: x_t = v} ||b_t||)^2)``, for a clipped
    sum that adds each row's scaled output gradients (``_embedding_clipped_sum``).
    """
    batch = indices.shape[0]
    ids = indices.reshape(batch, math.prod(indices.shape[1:]))
    tokens, width = ids.shape[1], backprops.shape[-1]
    wide = wide_dtype(backprops.device)
    b = backprops.reshape(batch * tokens, width).to(wide)
    sample = torch.arange(batch, device=ids.device).repeat_interleave(tokens)
    keys = sample * (int(ids.max()) + 1 if ids.numel() else 1) + ids.reshape(-1)
    if padding_idx is not None:
        b = b * (ids.reshape(-1) != padding_idx).unsqueeze(1)
    pairs, pair_of_token = torch.unique(keys, return_inverse=True)
    summed = b.new_zeros(len(pairs), width).index_add_(0, pair_of_token, b)
    row_magnitude = b.new_zeros(len(pairs)).index_add_(0, pair_of_token, torch.linalg.vector_norm(b, dim=1))
    sample_of_pair = b.new_zeros(len(pairs), dtype=torch.long).index_copy_(0, pair_of_token, sample) if len(pairs) else sample[:0]
    computed = b.new_zeros(batch).index_add_(0, sample_of_pair, summed.pow(2).sum(1))
    magnitude = b.new_zeros(batch).index_add_(0, sample_of_pair, row_magnitude.square()).sqrt()
    return certified_norms_sq(
        computed, magnitude * (1 + gamma(2 * tokens + width + 4, wide)),  # its sums of non-negative terms
        norm_terms=2 * tokens + width + 2, norm_dtype=wide,
        sum_terms=tokens + CLIP_ROUNDINGS, sum_dtype=at_least_float32_dtype(backprops.dtype),
    )


@register_norm_sampler(
    nn.Embedding, RenormedEmbedding, predicate=_not_scaled_by_frequency, clipped_sum=_embedding_clipped_sum, token_wise=True,
    linear_form=_embedding_form,
)
def embedding_norm_sampler(module: nn.Module, activations: Tensors, backprops: torch.Tensor):
    """``nn.Embedding``: sums over the rows each sample touches (neither ghost nor instantiated)."""
    weight = module.weight
    if not weight.requires_grad:
        return {}
    return {weight: embedding_norms_sq_by_rows(activations[0], backprops, module.padding_idx)}


# ----------------------------------------------------------------------------- shared inputs
#
# Linear layers that read the same input tensor (q/k/v, gate/up) share its Gram matrix for the
# norms and its clip-factor-scaled copy for the clipped sums: one ``B T^2 d`` Gram, and one
# elementwise pass over the input, per group instead of one per layer. Sharing is decided by
# memory identity (same storage, offset, shape, strides and dtype), never by value; every kept
# input is alive until the round ends, so equal addresses mean the same tensor.


def affine_layout(norm_sampler) -> Optional[bool]:
    """``in_by_out`` for the built-in ``nn.Linear`` / HF ``Conv1D`` norm samplers, None for any other."""
    if norm_sampler is None:
        return None
    if norm_sampler.norms_sq is linear_norm_sampler and norm_sampler.clipped_sum is _linear_clipped_sum:
        return False
    if norm_sampler.norms_sq is hf_conv1d_norm_sampler and norm_sampler.clipped_sum is _hf_conv1d_clipped_sum:
        return True
    return None


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


def shared_affine_norms_and_grads(uses) -> Tuple[list, list]:
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
    ``T d p`` matmul per sample.
    """
    results = [dict() for _ in uses]
    grads = [dict() for _ in uses]
    for group in group_by_input(uses):
        weighted = [i for i in group if uses[i].weight is not None]
        a = flatten_middle_dims(uses[group[0]].inputs)
        if weighted:
            a = at_least_float32_(a)
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
                    results[i][use.weight] = certify_linear(computed, a, b, terms, wide, dtype)
                else:
                    a_cast = a.to(dtype)
                    grad = torch.bmm(a_cast.transpose(1, 2), b) if use.in_by_out else torch.bmm(b.transpose(1, 2), a_cast)
                    results[i][use.weight] = squared_norms(grad)
                    grads[i][use.weight] = grad
            if use.bias is not None:  # the per-sample bias gradient is the summed output gradient
                grads[i][use.bias] = b.sum(1, dtype=at_least_float32_dtype(b.dtype))
                results[i][use.bias] = squared_norms(grads[i][use.bias])
    return results, grads


def weighted_sum(factor: torch.Tensor, per_sample: torch.Tensor) -> torch.Tensor:
    """``sum_i factor_i per_sample_i`` in float32 (or wider): one pass over the per-sample tensor."""
    dtype = at_least_float32_dtype(per_sample.dtype)
    return (factor.to(dtype) @ flatten_per_sample(per_sample.to(dtype))).view(per_sample.shape[1:])


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


def at_least_float32_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def at_least_float32_(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 (or wider); a float32 tensor is returned as is (no copy)."""
    return t.to(at_least_float32_dtype(t.dtype))
