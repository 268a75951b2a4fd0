"""Per-sample gradients of ``nn.Embedding`` and ``nn.EmbeddingBag``.

Both scatter (``index_add_``) each looked-up row's output gradient into a dense
``(B, num_embeddings, embedding_dim)`` tensor, at row ``sample * num_embeddings + index``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dptorch.grad_sample.registry import register_grad_sampler


def scatter_rows_per_sample(
    values: torch.Tensor,
    sample_ids: torch.Tensor,
    row_ids: torch.Tensor,
    batch: int,
    num_rows: int,
    scale_by_frequency: bool = False,
) -> torch.Tensor:
    """Sum ``values[j]`` (shape ``(n, D)``) into row ``row_ids[j]`` of sample ``sample_ids[j]``: ``(batch, num_rows, D)``.

    With ``scale_by_frequency`` each row is divided by how often it occurs in its own sample, the
    per-sample version of ``scale_grad_by_freq``.
    """
    flat_ids = sample_ids * num_rows + row_ids
    grads = values.new_zeros(batch * num_rows, values.shape[-1]).index_add_(0, flat_ids, values)
    if scale_by_frequency:
        counts = values.new_zeros(batch * num_rows).index_add_(0, flat_ids, values.new_ones(flat_ids.shape))
        grads = grads / counts.clamp(min=1).unsqueeze(-1)
    return grads.view(batch, num_rows, values.shape[-1])


@register_grad_sampler(nn.Embedding)
def embedding_grad_sampler(
    module: nn.Embedding, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """``nn.Embedding`` on indices ``(B, *rest)``; the ``padding_idx`` row gets zero, as in torch."""
    weight = module.weight
    if not weight.requires_grad:
        return {}
    indices = activations[0]
    batch = indices.shape[0]
    per_sample = math.prod(indices.shape[1:])
    sample_ids = torch.arange(batch, device=indices.device).repeat_interleave(per_sample)
    values = backprops.reshape(batch * per_sample, backprops.shape[-1])
    grads = scatter_rows_per_sample(
        values, sample_ids, indices.reshape(-1), batch, module.num_embeddings, module.scale_grad_by_freq
    )
    if module.padding_idx is not None:
        grads[:, module.padding_idx] = 0
    return {weight: grads.to(weight.dtype)}


def split_bag_inputs(
    module: nn.EmbeddingBag, activations: Tuple[torch.Tensor, ...]
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Flatten the bag inputs to ``(entries, bag_of_entry, per_sample_weights or None, counted)``.

    ``activations`` is ``(input,)``, ``(input, offsets)``, ``(input, offsets, per_sample_weights)``, or
    for 2-D input ``(input, per_sample_weights)``. ``counted`` masks the entries that enter their bag:
    not ``padding_idx`` and, with ``include_last_offset``, before the last offset.
    """
    indices = activations[0]
    if indices.dim() == 2:
        bags, length = indices.shape
        bag_of_entry = torch.arange(bags, device=indices.device).repeat_interleave(length)
        extra = [t for t in activations[1:] if t.shape == indices.shape and t.is_floating_point()]
        per_sample_weights = extra[0].reshape(-1) if extra else None
        entries = indices.reshape(-1)
        counted = torch.ones_like(entries, dtype=torch.bool)
    else:
        entries, offsets = indices, activations[1]
        per_sample_weights = activations[2] if len(activations) > 2 else None
        positions = torch.arange(entries.shape[0], device=entries.device, dtype=offsets.dtype)
        starts = offsets[:-1] if module.include_last_offset else offsets
        bag_of_entry = torch.searchsorted(starts, positions, right=True) - 1
        if module.include_last_offset:
            counted = positions < offsets[-1]
        else:
            counted = torch.ones_like(positions, dtype=torch.bool)
    if module.padding_idx is not None:
        counted = counted & (entries != module.padding_idx)
    return entries, bag_of_entry, per_sample_weights, counted


def first_max_entries(
    weight: torch.Tensor, entries: torch.Tensor, bag_of_entry: torch.Tensor, counted: torch.Tensor, bags: int
) -> torch.Tensor:
    """Mask ``(n, D)``: True where entry ``j`` is the (first) maximum of its bag in dimension ``d``."""
    rows = F.embedding(entries, weight.detach()).masked_fill(~counted.unsqueeze(-1), float("-inf"))
    bag_index = bag_of_entry.unsqueeze(-1).expand_as(rows)
    bag_max = rows.new_full((bags, rows.shape[-1]), float("-inf")).scatter_reduce(0, bag_index, rows, "amax")
    is_max = (rows == bag_max[bag_of_entry]) & counted.unsqueeze(-1)
    position = torch.arange(rows.shape[0], device=rows.device).unsqueeze(-1).expand_as(rows)
    candidate = torch.where(is_max, position, rows.shape[0])
    first = torch.full((bags, rows.shape[-1]), rows.shape[0], device=rows.device)
    first = first.scatter_reduce(0, bag_index, candidate, "amin")
    return position == first[bag_of_entry]


@register_grad_sampler(nn.EmbeddingBag)
def embedding_bag_grad_sampler(
    module: nn.EmbeddingBag, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """``nn.EmbeddingBag`` (sum / mean / max, offsets or 2-D input, per-sample weights): one bag = one sample."""
    weight = module.weight
    if not weight.requires_grad:
        return {}
    bags = backprops.shape[0]
    entries, bag_of_entry, per_sample_weights, counted = split_bag_inputs(module, activations)
    values = backprops[bag_of_entry]
    if module.mode == "max":
        values = values * first_max_entries(weight, entries, bag_of_entry, counted, bags)
    else:
        coefficient = counted.to(values.dtype)
        if per_sample_weights is not None:
            coefficient = coefficient * per_sample_weights
        if module.mode == "mean":
            bag_sizes = coefficient.new_zeros(bags).index_add_(0, bag_of_entry, counted.to(values.dtype))
            coefficient = coefficient / bag_sizes.clamp(min=1)[bag_of_entry]
        values = values * coefficient.unsqueeze(-1)
    grads = scatter_rows_per_sample(
        values, bag_of_entry, entries, bags, module.num_embeddings, module.scale_grad_by_freq
    )
    return {weight: grads.to(weight.dtype)}
