"""Linear / Conv1D calls of a packed forward (token privacy units): per-unit norms, per-unit gradients and
clipped sums from the packed ``(B, T, ...)`` tensors, without the ``(U, L)`` layout that pads every unit
to the longest.

The generic path (``TokenUnits.group``) lays every unit out as a row of ``L`` tokens, the longest unit's
length: on variable-length data that costs about what the padded batch did. Here the units are sorted
by length and cut into a few buckets (``PackedLayout``: at most ``MAX_BUCKETS``, the cut that pads least,
by dynamic programming over the distinct lengths); each bucket is a ``(U_k, L_k, ...)`` layout of its
units only, where ``shared_inputs.shared_affine_norms_and_grads`` forms the norms (ghost or instantiated
per bucket, as the row path chooses per call; certified for the clipped sum of the longest unit, as the
``(U, L)`` layout was). The clipped sum of a weight whose norms were not instantiated is one matmul over
those units' real tokens, each token's output gradient (or input) scaled by its unit's clip factor
(``shared_affine_clipped_sums`` with one token per "sample"): the cost of a plain weight gradient.
Instantiated gradients (and every bias's: the per-unit sum of ``g_t``) are kept, and summed with the
factors, as on rows.

Privacy: a pad token (id -1) is in no bucket and among no summed tokens, so it contributes nothing,
whatever its values; a bucket row holds one unit's tokens and zeros, so no two units meet in a Gram or
a per-unit gradient; a dropped unit's tokens are zeroed by ``torch.where`` before any product.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dptorch.grad_sample.layers.linear import linear_map_grad_samples
from dptorch.grad_sample.shared_inputs import (
    AffineUse,
    group_by_input,
    memory_key,
    shared_affine_clipped_sums,
    shared_affine_norms_and_grads,
)
from dptorch.grad_sample.token_units import TokenUnits

#: Buckets of units of similar length: each is one set of batched matmuls per layer call.
MAX_BUCKETS = 4
#: Distinct lengths the bucket search works over (longer rows: lengths rounded up to a grid first).
_MAX_LENGTHS = 256


@dataclass
class Bucket:
    """Units of similar length laid out as ``(len(units), width, ...)``."""

    units: torch.Tensor  # (U_k,) unit indices 0..U-1, ascending
    width: int
    source: torch.Tensor  # (n_k,) flat (row * T + token) positions of the bucket's tokens
    row: torch.Tensor  # (n_k,) each token's row in the bucket layout
    slot: torch.Tensor  # (n_k,) each token's place in its unit


class PackedLayout:
    """The real tokens of a packed batch, and its units in buckets of similar length."""

    def __init__(self, units: TokenUnits, max_buckets: int = MAX_BUCKETS) -> None:
        self.shape = tuple(units.shape)
        self.num_units, self.width = units.num_units, units.width
        index = units.index
        kept = index >= 0
        source = torch.nonzero(kept).flatten()
        unit = index[kept]
        order = torch.argsort(unit, stable=True)
        source, unit = source[order], unit[order]
        counts = torch.bincount(unit, minlength=self.num_units)
        slot = torch.arange(unit.numel(), device=unit.device) - (torch.cumsum(counts, 0) - counts)[unit]
        self.token_unit = index  # (B * T,): each token's unit, -1 for pads
        self.buckets: List[Bucket] = []
        self._all: Optional[torch.Tensor] = None
        for low, high in bucket_bounds(counts.tolist(), max_buckets):
            members = torch.nonzero((counts > low) & (counts <= high)).flatten()
            if members.numel() == 0:
                continue
            local = torch.full((self.num_units,), -1, dtype=torch.long, device=unit.device)
            local[members] = torch.arange(members.numel(), device=unit.device)
            mine = local[unit] >= 0
            self.buckets.append(Bucket(members, int(counts[members].max()), source[mine], local[unit[mine]], slot[mine]))

    def gather(self, x: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """``x`` of shape ``(B, T, *rest)`` as the bucket's ``(U_k, L_k, *rest)``: each unit's tokens, then zeros."""
        flat = x.reshape(-1, *x.shape[2:])
        out = flat.new_zeros((bucket.units.numel(), bucket.width, *x.shape[2:]))
        device = x.device
        out[bucket.row.to(device), bucket.slot.to(device)] = flat[bucket.source.to(device)]
        return out

    def tokens(self, buckets: Sequence[Bucket]) -> torch.Tensor:
        """Flat positions of the buckets' tokens."""
        if not buckets:
            return self.token_unit.new_zeros((0,))
        return torch.cat([b.source for b in buckets]) if len(buckets) > 1 else buckets[0].source

    def all_tokens(self) -> torch.Tensor:
        if self._all is None:
            self._all = self.tokens(self.buckets)
        return self._all


_LAYOUTS: "weakref.WeakKeyDictionary[TokenUnits, PackedLayout]" = weakref.WeakKeyDictionary()


def layout_of(units: TokenUnits) -> PackedLayout:
    """The ``PackedLayout`` of ``units``, made once per packed forward."""
    layout = _LAYOUTS.get(units)
    if layout is None:
        layout = _LAYOUTS[units] = PackedLayout(units)
    return layout


def bucket_bounds(lengths: Sequence[int], max_buckets: int) -> List[Tuple[int, int]]:
    """Length ranges ``(low, high]`` cutting the units into at most ``max_buckets`` buckets whose layouts
    (units times the bucket's longest length) hold the fewest tokens: exact over the distinct lengths
    (dynamic programming), over lengths rounded up to a grid of ``_MAX_LENGTHS`` steps for longer rows."""
    if not lengths:
        return []
    step = max(1, math.ceil(max(lengths) / _MAX_LENGTHS))
    values, counts = torch.unique(torch.tensor([-(-n // step) * step for n in lengths], dtype=torch.float64),
                                  return_counts=True)
    d = values.numel()
    before = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).double()  # units shorter than values[j]
    # area[i, j]: units with lengths values[i..j] in one bucket of width values[j]
    area = (before[1:][None, :] - before[:-1][:, None]) * values[None, :]
    area = torch.where(torch.ones(d, d, dtype=torch.bool).triu(), area, area.new_full((), math.inf))
    best = area[0].clone()  # best[j]: lengths values[0..j] in one bucket
    cuts: List[torch.Tensor] = []
    for _ in range(min(max_buckets, d) - 1):
        # the last bucket starts at values[i + 1]; the rest is best[i]
        total = torch.cat([area.new_full((1, d), math.inf), best[:-1, None] + area[1:]])
        value, start = total.min(0)
        better = value < best
        cuts.append(torch.where(better, start, start.new_full((), -1)))
        best = torch.where(better, value, best)
    bounds, j = [], d - 1
    for cut in reversed(cuts):
        i = int(cut[j])
        if i < 0:
            continue
        bounds.append((int(values[i - 1]) if i > 0 else 0, int(values[j])))
        j = i - 1
    bounds.append((0, int(values[j])))
    return bounds[::-1]


# ----------------------------------------------------------------------------- norms and kept gradients


@dataclass
class PackedKept:
    """What the norms of one packed use left for its clipped sum."""

    grads: Dict[nn.Parameter, torch.Tensor]  # per unit (U, ...): the bias's, and the weight's where instantiated
    unkept_tokens: Optional[torch.Tensor]  # flat positions of the tokens of units whose weight gradient is not kept


def packed_affine_norms_and_grads(uses: Sequence[AffineUse], layout: PackedLayout) -> Tuple[list, list]:
    """Squared per-unit norms ``{param: (U,)}`` (float64) and a ``PackedKept`` for each use of packed
    ``(B, T, ..., d)`` inputs; uses reading one input share its bucket layouts (and their Grams)."""
    results = [dict() for _ in uses]
    kept = [PackedKept({}, None) for _ in uses]
    for use, value, held in zip(uses, results, kept):  # zeros where a unit has no bucket: only with no unit at all
        for param in (use.weight, use.bias):
            if param is not None:
                value[param] = use.backprops.new_zeros(layout.num_units, dtype=torch.float64)
        if use.bias is not None:
            dtype = torch.promote_types(use.backprops.dtype, torch.float32)
            held.grads[use.bias] = use.backprops.new_zeros((layout.num_units, use.backprops.shape[-1]), dtype=dtype)
    sum_tokens = None
    for group in group_by_input(uses):
        a = uses[group[0]].inputs
        middle = math.prod(a.shape[2:-1])
        sum_tokens = layout.width * middle  # the clipped sum is certified for the longest unit, as in (U, L)
        unkept: List[Bucket] = []
        for bucket in layout.buckets:
            a_k = layout.gather(a, bucket)
            bucket_uses = [AffineUse(a_k, layout.gather(uses[i].backprops, bucket), uses[i].weight, uses[i].bias,
                                     uses[i].in_by_out) for i in group]
            squared, grads = shared_affine_norms_and_grads(bucket_uses, sum_tokens=sum_tokens)
            weight_kept = False
            for i, value, grad in zip(group, squared, grads):
                for param, v in value.items():
                    held = results[i][param]
                    held.index_copy_(0, bucket.units.to(held.device), v.to(torch.float64))
                for param, g in grad.items():
                    held = kept[i].grads.get(param)
                    if held is None:
                        held = kept[i].grads[param] = g.new_zeros((layout.num_units, *g.shape[1:]))
                    elif held.dtype != torch.promote_types(held.dtype, g.dtype):  # buckets of mixed dtypes: the wider
                        held = kept[i].grads[param] = held.to(torch.promote_types(held.dtype, g.dtype))
                    held.index_copy_(0, bucket.units.to(held.device), g.to(held.dtype))
                    weight_kept |= param is uses[i].weight
            if not weight_kept:
                unkept.append(bucket)
        # one tensor for the group (its uses stay one group); no unit at all: a sum over no token
        where = layout.tokens(unkept) if unkept or not layout.buckets else None
        for i in group:
            if uses[i].weight is not None:
                kept[i].unkept_tokens = where
    return results, kept


def packed_per_unit_grads(module: nn.Module, inputs: torch.Tensor, backprops: torch.Tensor, layout: PackedLayout,
                          in_by_out: bool, scale: float = 1.0) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-unit gradients ``(U, *param.shape)`` of a Linear / Conv1D call's trainable weight and bias
    (a tied or shared parameter: the strategy sums its uses), one bucket at a time."""
    out: Dict[nn.Parameter, torch.Tensor] = {}
    for bucket in layout.buckets:
        grads = linear_map_grad_samples(getattr(module, "weight", None), getattr(module, "bias", None),
                                        layout.gather(inputs, bucket), layout.gather(backprops, bucket),
                                        weight_is_in_by_out=in_by_out, scale=scale)
        for param, g in grads.items():
            held = out.get(param)
            if held is None:
                held = out[param] = g.new_empty((layout.num_units, *g.shape[1:]))
            held.index_copy_(0, bucket.units.to(held.device), g)
    return out


# ----------------------------------------------------------------------------- clipped sums


def packed_affine_clipped_sums(uses: Sequence[AffineUse], factors: Sequence[tuple], tokens: Sequence[Optional[torch.Tensor]],
                               layout: PackedLayout, dropped: Optional[torch.Tensor] = None) -> list:
    """``sum_u f_u G_u`` over the given tokens (flat positions; None: every real token) of each packed use,
    as one matmul over them: ``factors[k]`` are ``(weight_factor, bias_factor)`` per unit (float32 ``(U,)``,
    times the call's scale, or None), placed on each token of the unit; ``dropped`` units' tokens are zero."""
    token_uses, token_factors = [], []
    selected: Dict[tuple, torch.Tensor] = {}  # one gathered copy per (input, tokens): uses sharing them stay a group
    per_token: Dict[tuple, torch.Tensor] = {}

    def pick(x: torch.Tensor, where: torch.Tensor, key) -> torch.Tensor:
        if key not in selected:
            rows = x.reshape(-1, *x.shape[2:])[where.to(x.device)]
            if dropped is not None:
                gone = dropped.to(x.device)[layout.token_unit.to(x.device)[where.to(x.device)]]
                rows = torch.where(gone.view(-1, *([1] * (rows.dim() - 1))), rows.new_zeros(()), rows)
            selected[key] = rows
        return selected[key]

    def on_tokens(factor: Optional[torch.Tensor], where: torch.Tensor) -> Optional[torch.Tensor]:
        if factor is None:
            return None
        key = (id(factor), id(where))
        if key not in per_token:
            per_token[key] = factor[layout.token_unit.to(factor.device)[where.to(factor.device)]]
        return per_token[key]

    for use, (weight_factor, bias_factor), where in zip(uses, factors, tokens):
        where = layout.all_tokens() if where is None else where
        inputs = pick(use.inputs, where, (memory_key(use.inputs), id(where)))
        backprops = pick(use.backprops, where, (memory_key(use.backprops), id(where)))
        token_uses.append(AffineUse(inputs, backprops, use.weight, use.bias, use.in_by_out))
        token_factors.append((on_tokens(weight_factor, where), on_tokens(bias_factor, where)))
    return shared_affine_clipped_sums(token_uses, token_factors)
