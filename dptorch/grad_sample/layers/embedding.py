"""``nn.Embedding`` and ``nn.EmbeddingBag``: per-sample gradients, and their data-independent ``max_norm``;
for ``nn.Embedding`` also the norms (from the rows each sample touches), clipped sum and linear form.

Both grad samplers scatter (``index_add_``) each looked-up row's output gradient into a dense
``(B, num_embeddings, embedding_dim)`` tensor, at row ``sample * num_embeddings + index``.

torch's ``max_norm`` renormalises, in place, the rows a batch looks up, so the weights record
which indices the data held (validation refuses it). ``RenormedEmbedding`` and
``RenormedEmbeddingBag``, which ``ModuleValidator.fix`` swaps in, renormalise every row before
each lookup instead: the rows a lookup returns, and the gradient, are exactly torch's, and the
change to the weights no longer depends on the data.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dptorch.grad_sample.norms.certified import certified_norms_sq, gamma, wide_dtype
from dptorch.grad_sample.norms.linear_forms import CLIP_ROUNDINGS, LinearForm, at_least_float32, at_least_float32_dtype
from dptorch.grad_sample.layers.linear import param_shape
from dptorch.grad_sample.layers.registry import register_grad_sampler, register_norm_sampler

Tensors = Tuple[torch.Tensor, ...]


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


def index_probe(module: nn.Module, generator: torch.Generator) -> Tuple[torch.Tensor, ...]:
    """Two samples of three indices, the last repeating the first (a row used twice)."""
    ids = torch.randint(0, module.num_embeddings, (2, 3), generator=generator)
    ids[:, 2] = ids[:, 0]
    return (ids,)


def embedding_rows(
    module: nn.Embedding, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """The per-sample gradient of an ``nn.Embedding`` call as rows: ``(flat_ids, values, batch)``.

    Row ``values[j]`` (``(n, D)``) adds to row ``flat_ids[j]`` of the gradient viewed as
    ``(batch * num_embeddings, D)``. Lookups of ``padding_idx`` get zero values (torch gives that
    row no gradient). Not for ``scale_grad_by_freq`` (the rows then depend on each other).
    """
    indices = activations[0]
    batch = indices.shape[0]
    per_sample = math.prod(indices.shape[1:])
    ids = indices.reshape(-1)
    sample_ids = torch.arange(batch, device=indices.device).repeat_interleave(per_sample)
    values = backprops.reshape(batch * per_sample, backprops.shape[-1])
    if module.padding_idx is not None:
        values = values * (ids != module.padding_idx).unsqueeze(1).to(values.dtype)
    return sample_ids * module.num_embeddings + ids, values, batch


@register_grad_sampler(nn.Embedding, probe=index_probe)
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


@register_grad_sampler(nn.EmbeddingBag, probe=index_probe)
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


def renormalise_every_row(weight: torch.Tensor, max_norm: float, norm_type: float) -> None:
    """Scale, in place, every row of ``weight`` whose ``norm_type``-norm exceeds ``max_norm`` down to it.

    The same arithmetic as torch's ``max_norm`` (``torch.embedding_renorm_``), on all rows. Under
    expanded weights (``grad_sample_mode="ew"``) the parameter it wraps is renormalised.
    """
    with torch.no_grad():
        target = getattr(weight, "orig_weight", weight)
        rows = torch.arange(target.shape[0], device=target.device)
        torch.embedding_renorm_(target, rows, max_norm, norm_type)


class RenormedEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``max_norm`` (kept as ``renorm_max_norm``) applies to every row before
    each lookup, not to the looked-up rows only: no data-dependent change to the weights."""

    renorm_max_norm: float

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        renormalise_every_row(self.weight, self.renorm_max_norm, self.norm_type)
        return super().forward(input)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, renorm_max_norm={self.renorm_max_norm}"


class RenormedEmbeddingBag(nn.EmbeddingBag):
    """``nn.EmbeddingBag`` whose ``max_norm`` (kept as ``renorm_max_norm``) applies to every row."""

    renorm_max_norm: float

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None, per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        renormalise_every_row(self.weight, self.renorm_max_norm, self.norm_type)
        return super().forward(input, offsets, per_sample_weights)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, renorm_max_norm={self.renorm_max_norm}"


def renormalising_every_row(module: nn.Module) -> nn.Module:
    """``module`` (an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``max_norm``) turned, in place,
    into its ``Renormed*`` counterpart; other modules (and subclasses, whose forward it would lose)
    are returned unchanged."""
    if getattr(module, "max_norm", None) is None:
        return module
    renormed = {nn.Embedding: RenormedEmbedding, nn.EmbeddingBag: RenormedEmbeddingBag}.get(type(module))
    if renormed is None:
        return module
    module.__class__ = renormed
    module.renorm_max_norm = module.max_norm
    module.max_norm = None
    return module


# The renormalisation happens under no_grad before the lookup: the gradients are the plain layers'.
register_grad_sampler(RenormedEmbedding, probe=index_probe)(embedding_grad_sampler)
register_grad_sampler(RenormedEmbeddingBag, probe=index_probe)(embedding_bag_grad_sampler)


# ----------------------------------------------------------------------------- norms and clipped sums


def _embedding_form(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, LinearForm]:
    if not module.weight.requires_grad:
        return {}
    ids = activations[0].reshape(activations[0].shape[0], math.prod(activations[0].shape[1:]))
    right = backprops.reshape(ids.shape[0], ids.shape[1], backprops.shape[-1])
    if module.padding_idx is not None:  # the padding row gets no gradient
        right = right * (ids != module.padding_idx).unsqueeze(-1)
    return {module.weight: LinearForm(ids, right)}


def _embedding_clipped_sum(module: nn.Module, activations: Tensors, scaled_backprops: torch.Tensor):
    weight = module.weight
    if not weight.requires_grad:
        return {}
    batch = activations[0].shape[0]
    ids = activations[0].reshape(batch, math.prod(activations[0].shape[1:]))
    values = at_least_float32(scaled_backprops.reshape(ids.numel(), scaled_backprops.shape[-1]))
    if ids.shape[1] > 1:  # each sample's tokens of a row summed on their own first (``linear_forms.token_sums``)
        rows = SampleRows(ids, param_shape(weight)[0])
        ids, values = rows.row, rows.sum(values)
    summed = values.new_zeros(param_shape(weight)).index_add_(0, ids.reshape(-1), values)
    if module.padding_idx is not None:
        summed[module.padding_idx] = 0
    return {weight: summed.float()}


class SampleRows:
    """The (sample, row) pairs of ``(B, T)`` ids in ``B min(T, rows)`` slots (``rows``: the table's rows, as many
    pairs as a sample can have): ``row`` and ``sample`` of each slot, and ``sum``, which adds each token's values
    ``(B T, *F)`` into its pair's slot. Each sample's ids are sorted on their own and every sample's first token opens
    a slot, so a slot holds one sample's tokens whatever the ids (too many pairs for ``rows`` raise). Slots past the
    last pair hold no token (row 0 of sample 0, adding exactly 0), so no shape depends on the ids' values: a trace of
    the step can hold it (``benchmarks/captured_step.py``)."""

    def __init__(self, ids: torch.Tensor, rows: int) -> None:
        batch, tokens = ids.shape
        ordered, order = ids.sort(dim=1)
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        slot = first.reshape(-1).cumsum(0) - 1
        token = (order + torch.arange(batch, device=ids.device).unsqueeze(1) * tokens).reshape(-1)
        self._pair_of_token = torch.empty_like(slot).scatter_(0, token, slot)
        slots = batch * min(tokens, rows)
        samples = torch.arange(batch, device=ids.device).repeat_interleave(tokens)
        self.row = ids.new_zeros(slots).scatter_(0, slot, ordered.reshape(-1))  # a pair's tokens write one row
        self.sample = samples.new_zeros(slots).scatter_(0, slot, samples)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(len(self.row), *values.shape[1:]).index_add_(0, self._pair_of_token, values)


def _not_scaled_by_frequency(module: nn.Module) -> bool:
    return not module.scale_grad_by_freq


def embedding_norms_sq_by_rows(indices: torch.Tensor, backprops: torch.Tensor, padding_idx: Optional[int],
                               rows: int) -> torch.Tensor:
    """Certified per-sample squared norms from the rows each sample touches: ``sum_v ||sum_{t: x_t = v} b_t||^2``.

    Only the (sample, row) pairs that occur are formed (``SampleRows``, in ``B min(T, rows)`` slots; ``rows``: the
    table's rows), so the cost is about ``B T d`` whatever the vocabulary size, against ``B V d`` for the instantiated
    gradient. A row's output gradients can cancel over its repeated ids: the rows are summed in float64 and the
    result is certified (``certified``) with the magnitude ``sqrt(sum_v (sum_{t: x_t = v} ||b_t||)^2)``, for a
    clipped sum that adds each row's scaled output gradients (``_embedding_clipped_sum``).
    """
    batch = indices.shape[0]
    ids = indices.reshape(batch, math.prod(indices.shape[1:]))
    tokens, width = ids.shape[1], backprops.shape[-1]
    wide = wide_dtype(backprops.device)
    b = backprops.reshape(batch * tokens, width).to(wide)
    if padding_idx is not None:
        b = b * (ids.reshape(-1) != padding_idx).unsqueeze(1)
    pairs = SampleRows(ids, rows)
    summed = pairs.sum(b)
    row_magnitude = pairs.sum(torch.linalg.vector_norm(b, dim=1))
    computed = b.new_zeros(batch).index_add_(0, pairs.sample, summed.pow(2).sum(1))
    magnitude = b.new_zeros(batch).index_add_(0, pairs.sample, row_magnitude.square()).sqrt()
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
    return {weight: embedding_norms_sq_by_rows(activations[0], backprops, module.padding_idx, param_shape(weight)[0])}
