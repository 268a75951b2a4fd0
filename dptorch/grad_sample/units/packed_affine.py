"""Linear / Conv1D calls of a packed forward (token privacy units): per-unit norms, per-unit gradients and
clipped sums from the packed ``(B, T, ...)`` tensors, without the ``(U, L)`` layout that pads every unit
to the longest.

Where each unit's tokens are one run of the flattened ``(B * T)`` positions (``TokenUnits.spans``: what
packing collators emit), a unit is a pair of row slices of the packed tensors. A unit whose gradient bk
instantiates rather than form a ghost norm (``shared_inputs.ghost_norms_chosen`` at the unit's own
length, the rule of the row path) gets it as one matmul of its slices, written into its row of the kept
``(U, ...)`` per-unit gradient: no copy of the tokens, no padding. Every bias's per-unit gradient is one
``index_add`` of the token rows (pads into a row that is dropped).

The units left (ghost, one token; every unit when the tokens are not runs) are sorted by length and cut
into a few buckets (``PackedLayout.buckets_of``: at most ``MAX_BUCKETS``, the cut that pads least, by
dynamic programming over the distinct lengths); each bucket is a ``(U_k, L_k, ...)`` layout of its units
only (one gather for all buckets of a tensor), where ``shared_inputs.shared_affine_norms_and_grads``
forms the norms (certified for the clipped sum of the longest unit, as the ``(U, L)`` layout was). The
clipped sum of a weight whose norms were not instantiated is formed on the same bucket layouts, each
unit's output gradient (or input) scaled by its clip factor and each unit's tokens summed on their own
before the units are added (``shared_affine_clipped_sums``: the rounding the certified norm counts).
Instantiated gradients are kept, and summed with the factors, as on rows.

Privacy: a pad token (id -1) is in no span, no bucket and among no summed tokens, and adds only to the
dropped row of a bias sum, so it contributes nothing, whatever its values; a span or a bucket row holds
one unit's tokens (and zeros), so no two units meet in a Gram or a per-unit gradient; a dropped unit's
tokens are zeroed by ``torch.where`` before any product.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dptorch.grad_sample.layers.linear import common_dtype, linear_map_grad_samples
from dptorch.grad_sample.norms.linear_forms import STACK_LIMIT, at_least_float32_dtype, squared_norms
from dptorch.grad_sample.norms.shared_inputs import (
    AffineUse,
    ghost_norms_chosen,
    group_by_input,
    memory_key,
    shared_affine_clipped_sums,
    shared_affine_norms_and_grads,
)
from dptorch.grad_sample.units.token_units import TokenUnits, scatter_rows

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
    dest: torch.Tensor  # (n_k,) each token's flat place (row * width + place in its unit) in the bucket layout


class PackedLayout:
    """The real tokens of a packed batch: its units as runs of positions (``spans``, where they are) and
    in buckets of similar length."""

    def __init__(self, units: TokenUnits, max_buckets: int = MAX_BUCKETS) -> None:
        # the tokens unit by unit (not the units themselves: _LAYOUTS holds layouts weakly keyed by them)
        self._source, self._unit, self._slot = units.source, units.unit, units.slot
        self.shape = tuple(units.shape)
        self.num_units, self.width = units.num_units, units.width
        self.token_unit = units.index  # (B * T,): each token's unit, -1 for pads
        self.lengths: List[int] = units.counts.tolist()
        self.spans: Optional[List[Tuple[int, int]]] = units.spans()
        self.max_buckets = max_buckets
        self._buckets: Dict[Optional[tuple], List[Bucket]] = {}
        self._gathers: Dict[tuple, tuple] = {}
        self._tokens: Dict[tuple, torch.Tensor] = {}
        self._listed: Dict[int, List[Bucket]] = {}
        self._bias_rows: Optional[torch.Tensor] = None

    @property
    def buckets(self) -> List[Bucket]:
        """Every unit's bucket."""
        return self.buckets_of(None)

    def buckets_of(self, members: Optional[Tuple[int, ...]]) -> List[Bucket]:
        """The buckets of the units ``members`` (ascending; None: every unit), cut where they pad least."""
        held = self._buckets.get(members)
        if held is not None:
            return held
        chosen = range(self.num_units) if members is None else members
        lengths = [self.lengths[u] for u in chosen]
        device = self.token_unit.device
        buckets = []
        for low, high in bucket_bounds(lengths, self.max_buckets):
            inside = [u for u, n in zip(chosen, lengths) if low < n <= high]
            if not inside:
                continue
            width = max(self.lengths[u] for u in inside)
            members_k = torch.tensor(inside, dtype=torch.long, device=device)
            local = torch.full((self.num_units,), -1, dtype=torch.long, device=device)
            local[members_k] = torch.arange(len(inside), device=device)
            row = local[self._unit]
            mine = row >= 0
            buckets.append(Bucket(members_k, width, self._source[mine], row[mine] * width + self._slot[mine]))
        self._buckets[members] = buckets
        return buckets

    def gather(self, x: torch.Tensor, buckets: Sequence[Bucket]) -> List[torch.Tensor]:
        """``x`` of shape ``(B, T, *rest)`` as each bucket's ``(U_k, L_k, *rest)``: each unit's tokens, then
        zeros (one gather into one tensor for all the buckets)."""
        if not buckets:
            return []
        key = tuple(id(b) for b in buckets)  # the buckets are held by this layout: their ids name no others
        held = self._gathers.get(key)
        if held is None:
            sizes = [b.units.numel() * b.width for b in buckets]
            starts = [sum(sizes[:k]) for k in range(len(buckets))]
            source = torch.cat([b.source for b in buckets])
            dest = torch.cat([b.dest + start for b, start in zip(buckets, starts)])
            held = self._gathers[key] = (source, dest, sizes)
        source, dest, sizes = held
        rest = x.shape[2:]
        flat = scatter_rows(x.reshape(-1, *rest), source, dest, (sum(sizes),))
        return [part.view(b.units.numel(), b.width, *rest) for b, part in zip(buckets, flat.split(sizes))]

    def tokens(self, buckets: Sequence[Bucket]) -> torch.Tensor:
        """Flat positions of the buckets' tokens."""
        key = tuple(id(b) for b in buckets)
        held = self._tokens.get(key)
        if held is None:
            sources = [b.source for b in buckets] or [self.token_unit.new_zeros((0,))]
            held = self._tokens[key] = torch.cat(sources) if len(sources) > 1 else sources[0]
            self._listed[id(held)] = list(buckets)  # held by _tokens: the id names no other tensor
        return held

    def buckets_listed(self, tokens: torch.Tensor) -> List[Bucket]:
        """The buckets whose tokens ``tokens`` lists (flat positions of whole units): those it was made of
        (``tokens``), else the buckets of the units it holds."""
        listed = self._listed.get(id(tokens))
        if listed is not None and self._tokens.get(tuple(id(b) for b in listed)) is tokens:
            return listed
        units = torch.unique(self.token_unit[tokens.to(self.token_unit.device)])
        return self.buckets_of(tuple(units.tolist()))

    def all_tokens(self) -> torch.Tensor:
        """Flat positions of every real token (unit by unit)."""
        return self._source

    def unit_sums(self, rows: torch.Tensor) -> torch.Tensor:
        """``(U, *rest)``: the sum of the rows ``(B * T, *rest)`` of each unit's tokens (a pad's row goes to
        an extra row, dropped)."""
        if self._bias_rows is None:
            self._bias_rows = torch.where(self.token_unit >= 0, self.token_unit, self.num_units)
        index = self._bias_rows if self._bias_rows.device == rows.device else self._bias_rows.to(rows.device)
        return rows.new_zeros((self.num_units + 1, *rows.shape[1:])).index_add_(0, index, rows)[: self.num_units]


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
    ``(B, T, ..., d)`` inputs; uses reading one input share its slices and bucket layouts (and their Grams),
    and the groups of one bucket layout are formed together (``shared_inputs.stacks`` stacks equal shapes)."""
    results = [dict() for _ in uses]
    kept = [PackedKept({}, None) for _ in uses]
    pending: Dict[tuple, Tuple[List[Bucket], list]] = {}  # (buckets, middle, biases) -> the groups they serve
    for group in group_by_input(uses):
        a = uses[group[0]].inputs
        middle, d = math.prod(a.shape[2:-1]), a.shape[-1]
        weighted = [i for i in group if uses[i].weight is not None]
        for i in group:  # zeros where a unit has no result: only with no unit at all
            for param in (uses[i].weight, uses[i].bias):
                if param is not None:
                    results[i][param] = uses[i].backprops.new_zeros(layout.num_units, dtype=torch.float64)
        if layout.spans is None:  # tokens that are no runs: every unit in buckets, biases too
            direct, buckets, in_buckets = [], layout.buckets, group
        else:
            direct, buckets = _span_norms(uses, group, weighted, a, middle, d, layout, results, kept)
            in_buckets = weighted
        for i in weighted:  # no unit at all: a sum over no token; every unit direct: all kept
            kept[i].unkept_tokens = None if direct else layout.tokens([])
        if buckets and in_buckets:
            key = (tuple(id(b) for b in buckets), middle, layout.spans is None)
            pending.setdefault(key, (buckets, []))[1].append((in_buckets, weighted, a))
    for (_, middle, biases), (buckets, groups) in pending.items():
        unkept = _bucket_norms(uses, [(in_buckets, a) for in_buckets, _, a in groups], buckets, middle, layout,
                               results, kept, biases)
        for (_, weighted, _), where in zip(groups, unkept):
            for i in weighted:  # one tensor for the group (its uses stay one group)
                kept[i].unkept_tokens = layout.tokens(where) if where else None
    return results, kept


def _span_norms(uses: Sequence[AffineUse], group: List[int], weighted: List[int], a: torch.Tensor, middle: int, d: int,
                layout: PackedLayout, results: list, kept: list) -> Tuple[List[int], List[Bucket]]:
    """The group's biases, and from the units' token runs the weights of the units whose gradient is cheaper
    to instantiate (the row path's rule at the unit's length), or of every unit when the others' gradients
    are small (``STACK_LIMIT`` numbers in all: there a ghost bucket's thirty torch calls per use cost more
    than one matmul call per unit); returns those units and the buckets of the others (ghost, one token)."""
    widths = [uses[i].backprops.shape[-1] for i in weighted]
    direct = [u for u, n in enumerate(layout.lengths)
              if weighted and n * middle > 1 and not ghost_norms_chosen(n * middle, d, widths)]
    if weighted and (layout.num_units - len(direct)) * d * sum(widths) <= STACK_LIMIT:
        direct = list(range(layout.num_units))
    chosen = set(direct)
    rest = tuple(u for u in range(layout.num_units) if u not in chosen) if weighted else ()
    for i in group:
        if uses[i].bias is not None:
            _span_bias(uses[i], a, middle, layout, results[i], kept[i])
    if direct:
        _span_weights([uses[i] for i in weighted], a, middle, direct, rest, layout,
                      [results[i] for i in weighted], [kept[i] for i in weighted])
    return direct, layout.buckets_of(rest) if rest else []


def _span_bias(use: AffineUse, a: torch.Tensor, middle: int, layout: PackedLayout, result: dict, held: PackedKept) -> None:
    """A bias's per-unit gradient: its unit's sum of the output gradient rows (kept), and its squared norm."""
    b = use.backprops
    dtype = at_least_float32_dtype(b.dtype)
    if use.weight is not None:  # as the row path: the output gradient in the weight's product dtype
        dtype = torch.promote_types(at_least_float32_dtype(a.dtype), dtype)
    rows = b.reshape(-1, middle, b.shape[-1]).sum(1, dtype=dtype) if middle > 1 else _as(b.reshape(-1, b.shape[-1]), dtype)
    grad = held.grads[use.bias] = layout.unit_sums(rows)
    result[use.bias] = squared_norms(grad).to(torch.float64)


def _span_weights(uses: Sequence[AffineUse], a: torch.Tensor, middle: int, direct: List[int], others: Sequence[int],
                  layout: PackedLayout, results: list, kept: list) -> None:
    """Per-unit weight gradients of the ``direct`` units, each the matmul of its token slices, in the kept
    ``(U, ...)`` tensor (zero rows for the ``others``), and their squared norms."""
    rows: Dict[torch.dtype, torch.Tensor] = {}
    for use, result, held in zip(uses, results, kept):
        b = use.backprops
        dtype = torch.promote_types(at_least_float32_dtype(a.dtype), at_least_float32_dtype(b.dtype))
        if dtype not in rows:
            rows[dtype] = _as(a.reshape(-1, a.shape[-1]), dtype)
        x, y = rows[dtype], _as(b.reshape(-1, b.shape[-1]), dtype)
        shape = (layout.num_units, x.shape[1], y.shape[1]) if use.in_by_out else (layout.num_units, y.shape[1], x.shape[1])
        grad = x.new_empty(shape)
        if others:
            grad.index_fill_(0, torch.tensor(others, device=grad.device), 0)
        _per_span_products(x, y, [layout.spans[u] for u in direct], middle, [grad[u] for u in direct], use.in_by_out)
        held.grads[use.weight] = grad
        result[use.weight] = squared_norms(grad).to(torch.float64)


def _per_span_products(x: torch.Tensor, y: torch.Tensor, spans: Sequence[Tuple[int, int]], middle: int,
                       outs: Sequence[torch.Tensor], in_by_out: bool) -> None:
    """``out = y_s^T x_s`` (``x_s^T y_s`` if ``in_by_out``) over the rows of each span (tokens times ``middle``)."""
    for (start, stop), out in zip(spans, outs):
        xs, ys = x[start * middle: stop * middle], y[start * middle: stop * middle]
        torch.mm(xs.T, ys, out=out) if in_by_out else torch.mm(ys.T, xs, out=out)


def _bucket_norms(uses: Sequence[AffineUse], groups: list, buckets: List[Bucket], middle: int, layout: PackedLayout,
                  results: list, kept: list, biases: bool) -> List[List[Bucket]]:
    """Norms (and kept gradients) of the uses of each ``(indices, input)`` group (their biases too if
    ``biases``) for the units of ``buckets``, placed in the per-unit results, all groups of a bucket in one
    ``shared_affine_norms_and_grads``; per group, the buckets whose weight gradients were not kept."""
    sum_tokens = layout.width * middle  # the clipped sum is certified for the longest unit, as in (U, L)
    inputs = [layout.gather(a, buckets) for _, a in groups]
    backprops = [{i: layout.gather(uses[i].backprops, buckets) for i in indices} for indices, _ in groups]
    order = [i for indices, _ in groups for i in indices]
    unkept: List[List[Bucket]] = [[] for _ in groups]
    for k, bucket in enumerate(buckets):
        bucket_uses = [AffineUse(inputs[g][k], backprops[g][i][k], uses[i].weight, uses[i].bias if biases else None,
                                 uses[i].in_by_out) for g, (indices, _) in enumerate(groups) for i in indices]
        squared, grads = shared_affine_norms_and_grads(bucket_uses, sum_tokens=sum_tokens)
        units = bucket.units
        weight_kept = set()
        for i, value, grad in zip(order, squared, grads):
            for param, v in value.items():
                held = results[i][param]
                held.index_copy_(0, units if units.device == held.device else units.to(held.device), v.to(torch.float64))
            for param, g in grad.items():
                held = kept[i].grads.get(param)
                if held is None:
                    held = kept[i].grads[param] = g.new_zeros((layout.num_units, *g.shape[1:]))
                elif held.dtype != torch.promote_types(held.dtype, g.dtype):  # buckets of mixed dtypes: the wider
                    held = kept[i].grads[param] = held.to(torch.promote_types(held.dtype, g.dtype))
                held.index_copy_(0, units if units.device == held.device else units.to(held.device), g.to(held.dtype))
                if param is uses[i].weight:
                    weight_kept.add(i)
        for g, (indices, _) in enumerate(groups):
            if not weight_kept.intersection(indices):
                unkept[g].append(bucket)
    return unkept


def packed_per_unit_grads(module: nn.Module, inputs: torch.Tensor, backprops: torch.Tensor, layout: PackedLayout,
                          in_by_out: bool, scale: float = 1.0) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-unit gradients ``(U, *param.shape)`` of a Linear / Conv1D call's trainable weight and bias
    (a tied or shared parameter: the strategy sums its uses): one matmul per unit's slices where the
    units are runs of tokens, bucket by bucket otherwise."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    out: Dict[nn.Parameter, torch.Tensor] = {}
    if layout.spans is None:
        buckets = layout.buckets
        for bucket, a_k, b_k in zip(buckets, layout.gather(inputs, buckets), layout.gather(backprops, buckets)):
            grads = linear_map_grad_samples(weight, bias, a_k, b_k, weight_is_in_by_out=in_by_out, scale=scale)
            for param, g in grads.items():
                held = out.get(param)
                if held is None:
                    held = out[param] = g.new_empty((layout.num_units, *g.shape[1:]))
                held.index_copy_(0, bucket.units.to(held.device), g)
        return out
    middle = math.prod(inputs.shape[2:-1])
    b_rows = backprops.reshape(-1, backprops.shape[-1])
    if weight is not None and weight.requires_grad:  # as linear_map_grad_samples: the promoted dtype, then the weight's
        x, y = common_dtype(inputs.reshape(-1, inputs.shape[-1]), b_rows)
        shape = (layout.num_units, x.shape[1], y.shape[1]) if in_by_out else (layout.num_units, y.shape[1], x.shape[1])
        grad = x.new_empty(shape)
        _per_span_products(x, y, layout.spans, middle, grad.unbind(0), in_by_out)
        out[weight] = (grad.mul_(scale) if scale != 1.0 else grad).to(weight.dtype)
    if bias is not None and bias.requires_grad:
        rows = b_rows.reshape(-1, middle, b_rows.shape[-1]).sum(1) if middle > 1 else b_rows
        summed = layout.unit_sums(rows)
        out[bias] = (summed.mul_(scale) if scale != 1.0 else summed).to(bias.dtype)
    return out


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


# ----------------------------------------------------------------------------- clipped sums


def packed_affine_clipped_sums(uses: Sequence[AffineUse], factors: Sequence[tuple], tokens: Sequence[Optional[torch.Tensor]],
                               layout: PackedLayout, dropped: Optional[torch.Tensor] = None) -> list:
    """``sum_u f_u G_u`` over the given tokens (flat positions of whole units; None: every real token) of each
    packed use: ``factors[k]`` are ``(weight_factor, bias_factor)`` per unit (float32 ``(U,)``, times the call's
    scale, or None); ``dropped`` units' tokens are zero. The tokens are laid out in their units' buckets
    (``(U_k, L_k, ...)``, each unit a row), so each unit's tokens are summed on their own before the units are
    added (``shared_affine_clipped_sums``, ``linear_forms.token_sums``: the rounding its norm is certified for)."""
    per_bucket_uses, per_bucket_factors, owner = [], [], []
    gathered: Dict[tuple, List[torch.Tensor]] = {}  # one gathered copy per (input, tokens): uses sharing them stay a group
    per_unit: Dict[tuple, torch.Tensor] = {}  # one tensor per (factor, bucket): uses sharing a factor scale their input once

    def on_units(factor: Optional[torch.Tensor], bucket: Bucket) -> Optional[torch.Tensor]:
        if factor is None:
            return None
        key = (id(factor), id(bucket))
        if key not in per_unit:
            per_unit[key] = factor[bucket.units.to(factor.device)]
        return per_unit[key]

    def pick(x: torch.Tensor, buckets: List[Bucket], key) -> List[torch.Tensor]:
        if key not in gathered:
            parts = layout.gather(x, buckets)
            if dropped is not None:
                gone = [dropped.to(x.device)[b.units.to(x.device)] for b in buckets]
                parts = [torch.where(g.view(-1, *([1] * (t.dim() - 1))), t.new_zeros(()), t) for g, t in zip(gone, parts)]
            gathered[key] = parts
        return gathered[key]

    for k, (use, (weight_factor, bias_factor), where) in enumerate(zip(uses, factors, tokens)):
        buckets = layout.buckets if where is None else layout.buckets_listed(where)
        key = id(where)
        inputs = pick(use.inputs, buckets, (memory_key(use.inputs), key))
        backprops = pick(use.backprops, buckets, (memory_key(use.backprops), key))
        for bucket, x, b in zip(buckets, inputs, backprops):
            per_bucket_uses.append(AffineUse(x, b, use.weight, use.bias, use.in_by_out))
            per_bucket_factors.append((on_units(weight_factor, bucket), on_units(bias_factor, bucket)))
            owner.append(k)
    results = [{p: torch.zeros(p.shape, device=p.device)  # a sum over no token: zeros
                for p, f in zip((use.weight, use.bias), pair) if p is not None and f is not None}
               for use, pair in zip(uses, factors)]
    for k, summed in zip(owner, shared_affine_clipped_sums(per_bucket_uses, per_bucket_factors)):
        for param, value in summed.items():
            results[k][param] += value
    return results
