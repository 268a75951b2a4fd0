"""Per-sample gradient norms without per-sample gradients, and clipped sums from (a, b).

For a layer that is linear in its weight, sample ``i``'s gradient is ``G_i = sum_t b_it a_it^T``.
Its squared norm is ``sum_{t,t'} (a_it . a_it')(b_it . b_it')`` (the "ghost" form, cost about
``B T^2 (d + p)``) or, instantiated, ``||einsum(b, a)||^2`` (cost ``B T d p``); each call picks
the cheaper ("mixed ghost clipping"). The clipped sum ``sum_i c_i G_i`` is the ordinary weight
gradient with each sample's ``b`` scaled by ``c_i`` (book-keeping: no second backward pass).
Norms and clipped sums are computed in float32 at least: bf16 activations and output gradients
are upcast, so the clip factors are never rounded to bf16 and nothing is accumulated in it.

A norm sampler is ``(module, activations, backprops) -> {param: squared norm per sample}``;
its clipped-sum partner takes backprops already scaled per sample and returns batch gradients.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

from dataclasses import dataclass

from dptorch.grad_sample.layers.embedding import RenormedEmbedding
from dptorch.grad_sample.layers.hf_conv1d import looks_like_hf_conv1d
from dptorch.grad_sample.layers.linear import flatten_middle_dims
from dptorch.grad_sample.registry import register_norm_sampler

Tensors = Tuple[torch.Tensor, ...]


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


def _left_gram(x: LinearForm, y: LinearForm) -> torch.Tensor:
    """``(left_x[t] . left_y[t'])`` for each sample: ``(B, T_x, T_y)``."""
    if x.indexed and y.indexed:
        return (x.left.unsqueeze(2) == y.left.unsqueeze(1)).float()
    if x.indexed:
        return _left_gram(y, x).transpose(1, 2)
    if y.indexed:  # one-hot rows pick columns of the dense factor
        index = y.left.unsqueeze(1).expand(-1, x.left.shape[1], -1)
        return x.left.float().gather(2, index)
    return torch.bmm(x.left.float(), y.left.float().transpose(1, 2))


def form_inner_products(x: LinearForm, y: LinearForm) -> torch.Tensor:
    """``<G_i, H_i>`` (Frobenius) for each sample, from the factors alone."""
    right = torch.bmm(x.right.float(), y.right.float().transpose(1, 2))
    return torch.einsum("bts,bts->b", _left_gram(x, y), right)


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
    ids = activations[0].reshape(activations[0].shape[0], -1)
    right = backprops.reshape(ids.shape[0], ids.shape[1], -1)
    if module.padding_idx is not None:  # the padding row gets no gradient
        right = right * (ids != module.padding_idx).unsqueeze(-1)
    return {module.weight: LinearForm(ids, right)}


def _trainable(param: Optional[nn.Parameter]) -> bool:
    return param is not None and param.requires_grad


def linear_weight_norms_sq(inputs: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """Squared norms of ``sum_t b_t a_t^T`` per sample, ghost or instantiated, whichever is cheaper."""
    a = flatten_middle_dims(inputs).float()
    b = flatten_middle_dims(backprops).float()
    tokens, d, p = a.shape[1], a.shape[2], b.shape[2]
    if tokens == 1:
        return squared_norms(a) * squared_norms(b)
    if tokens * (d + p) < d * p:
        return torch.einsum("bts,bts->b", torch.bmm(a, a.transpose(1, 2)), torch.bmm(b, b.transpose(1, 2)))
    return squared_norms(torch.bmm(b.transpose(1, 2), a))


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
    if _trainable(bias):
        norms[bias] = squared_norms(flatten_middle_dims(backprops).float().sum(1))
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
    values = _at_least_float32(scaled_backprops.reshape(ids.shape[0], -1))
    summed = values.new_zeros(weight.shape).index_add_(0, ids, values)
    if module.padding_idx is not None:
        summed[module.padding_idx] = 0
    return {weight: summed.float()}


def _not_scaled_by_frequency(module: nn.Module) -> bool:
    return not module.scale_grad_by_freq


def embedding_norms_sq_by_rows(indices: torch.Tensor, backprops: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
    """Per-sample squared norms from the rows each sample touches: ``sum_v ||sum_{t: x_t = v} b_t||^2``.

    Only the (sample, row) pairs that occur are formed, so the cost is about ``B T d`` whatever
    the vocabulary size, against ``B V d`` for the instantiated gradient.
    """
    ids = indices.reshape(indices.shape[0], -1)
    batch, tokens = ids.shape
    b = backprops.reshape(batch * tokens, -1).float()
    sample = torch.arange(batch, device=ids.device).repeat_interleave(tokens)
    keys = sample * (int(ids.max()) + 1 if ids.numel() else 1) + ids.reshape(-1)
    if padding_idx is not None:
        b = b * (ids.reshape(-1) != padding_idx).unsqueeze(1)
    pairs, pair_of_token = torch.unique(keys, return_inverse=True)
    summed = b.new_zeros(len(pairs), b.shape[1]).index_add_(0, pair_of_token, b)
    sample_of_pair = b.new_zeros(len(pairs), dtype=torch.long).index_copy_(0, pair_of_token, sample) if len(pairs) else sample[:0]
    return b.new_zeros(batch).index_add_(0, sample_of_pair, summed.pow(2).sum(1))


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
