"""Clipped sums held as each rank's partition of flat spaces (DeepSpeed ZeRO-1, 2 and 3), and the noised partition.

A flat space (:class:`FlatSpace`) lays parameters side by side, flattened row-major, in one flat vector of
``world * size`` elements cut into ``world`` equal partitions: rank ``r`` owns elements ``[r * size, (r + 1) *
size)``; what no parameter covers is padding. ZeRO-3 makes one space per parameter (``ceil(numel / world)``
elements per rank, the last rank's padded); ZeRO-1/2 one per parameter group (its flat buffer of the group's
parameters, with DeepSpeed's alignment padding).

* :func:`keep_in_partitions`, after every backward pass on every rank (zeros for a pass that adds nothing, so the
  ranks meet in every collective): the pass's clipped sums, summed over the ranks, are added to what this rank
  holds, ``optimizer._summed[p]``: the part of ``p``'s sum this rank owns (a range of its flat elements; nothing
  for a parameter that lies wholly in other ranks' partitions). Reduce-scatters of buckets of at most
  :data:`BUCKET` elements; a bucket takes the same columns of every rank's partition (no rank's share of a
  bucket is padding), and a parameter's full-size clipped sum is formed once per pass, one layer at a time,
  when a bucket first needs it, and dropped after the last bucket that needs it.
* :func:`noised_partitions`, at the step: each space's partition on this rank, ``(sum of the ranks' clipped sums +
  noise) / divisor``, the noise this rank's slice of one stream (``ShardedNoise``: every element drawn once, by
  its owner, the values of one process's draw). Nothing full-size is drawn and nothing is averaged.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dptorch.distributed.fsdp import groups_by_module, sharded_noise

#: Elements (of the ranks' rows, fp32) reduce-scattered in one collective: 64 MiB at the most.
BUCKET = 1 << 24


@dataclass(frozen=True)
class FlatSpace:
    """Parameters side by side in one flat vector cut into equal partitions of ``size`` elements, one per rank."""

    size: int
    params: Tuple[nn.Parameter, ...]
    offsets: Tuple[int, ...]  # each parameter's first element in the flat vector (ascending)
    numels: Tuple[int, ...]
    device: torch.device

    def overlapping(self, start: int, end: int) -> Iterator[Tuple[int, int, int]]:
        """``(index, first, last)`` of each parameter with flat elements in ``[start, end)``: its elements
        ``first:last``."""
        index = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        while index < len(self.params) and self.offsets[index] < end:
            offset = self.offsets[index]
            first, last = max(start, offset) - offset, min(end, offset + self.numels[index]) - offset
            if last > first:
                yield index, first, last
            index += 1

    def owned(self, index: int, rank: int) -> Tuple[int, int]:
        """The elements ``first:last`` of parameter ``index`` in ``rank``'s partition (``first == last``: none)."""
        offset = self.offsets[index]
        first = max(offset, rank * self.size) - offset
        last = min(offset + self.numels[index], (rank + 1) * self.size) - offset
        return (first, last) if last > first else (0, 0)


def _rank_and_world() -> Tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


Window = Tuple[int, int, int, int]  # (space, first column of every rank's partition, its end, column in the row)


def _buckets(spaces: Sequence[FlatSpace], world: int) -> List[List[Window]]:
    """The spaces' partitions cut into buckets of at most ``BUCKET // world`` columns per rank, in order."""
    width = max(1, BUCKET // world)
    buckets: List[List[Window]] = [[]]
    used = 0
    for index, space in enumerate(spaces):
        start = 0
        while start < space.size:
            if used == width:
                buckets.append([])
                used = 0
            end = min(space.size, start + width - used)
            buckets[-1].append((index, start, end, used))
            used += end - start
            start = end
    return [bucket for bucket in buckets if bucket]


def _needed(spaces: Sequence[FlatSpace], bucket: List[Window], world: int) -> List[Tuple[int, int]]:
    """``(space, parameter index)`` of every parameter with elements in ``bucket`` on any rank, in order."""
    needed: Dict[Tuple[int, int], None] = {}
    for index, start, end, _ in bucket:
        size = spaces[index].size
        for rank in range(world):
            for param, _, _ in spaces[index].overlapping(rank * size + start, rank * size + end):
                needed[(index, param)] = None
    return list(needed)


@torch.no_grad()
def keep_in_partitions(optimizer: Any, hooks: Any, factors: Dict[nn.Parameter, torch.Tensor],
                       dropped: Optional[torch.Tensor], spaces: Sequence[FlatSpace]) -> None:
    """Add this backward pass's clipped sums, summed over the ranks, to the parts of them this rank owns
    (``optimizer._summed``). Every rank, every pass, every space in the same order: the collectives pair up."""
    rank, world = _rank_and_world()
    buckets = _buckets(spaces, world)
    needs = [_needed(spaces, bucket, world) for bucket in buckets]
    last_use = {key: number for number, keys in enumerate(needs) for key in keys}
    sums: Dict[Tuple[int, int], Optional[torch.Tensor]] = {}  # full-size, flat, fp32; None: zero this pass
    for number, (bucket, needed) in enumerate(zip(buckets, needs)):
        _form_clipped_sums(hooks, factors, dropped, spaces, [key for key in needed if key not in sums], sums)
        columns = sum(end - start for _, start, end, _ in bucket)
        rows = torch.zeros(world, columns, dtype=torch.float32, device=spaces[bucket[0][0]].device)
        for index, start, end, column in bucket:
            space = spaces[index]
            for row in range(world):
                base = row * space.size + start
                for param, first, last in space.overlapping(base, row * space.size + end):
                    flat = sums[(index, param)]
                    if flat is not None:
                        at = column + space.offsets[param] + first - base
                        rows[row, at: at + last - first] = flat[first:last]
        mine = rows[0] if world == 1 else _reduce_scatter(rows)
        del rows
        for index, start, end, column in bucket:
            space = spaces[index]
            base = rank * space.size + start
            for param, first, last in space.overlapping(base, rank * space.size + end):
                owned_first, owned_last = space.owned(param, rank)
                held = optimizer._summed.get(space.params[param])
                if held is None:
                    held = optimizer._summed[space.params[param]] = mine.new_zeros(owned_last - owned_first)
                at = column + space.offsets[param] + first - base
                held[first - owned_first: last - owned_first] += mine[at: at + last - first]
        for key in needed:
            if last_use[key] == number:
                del sums[key]


def _form_clipped_sums(hooks: Any, factors: Dict[nn.Parameter, torch.Tensor], dropped: Optional[torch.Tensor],
                       spaces: Sequence[FlatSpace], keys: List[Tuple[int, int]],
                       sums: Dict[Tuple[int, int], Optional[torch.Tensor]]) -> None:
    """The full-size clipped sums of the parameters ``keys`` into ``sums``, one layer at a time."""
    where = {spaces[index].params[param]: (index, param) for index, param in keys}
    for group in groups_by_module(hooks, list(where)):
        wanted = {p: factors[p] for p in group if p in factors}
        formed = hooks.clipped_sums(wanted, dropped) if wanted else {}
        for p in group:
            index, param = where[p]
            clipped = formed.get(p)
            if clipped is not None and clipped.numel() != spaces[index].numels[param]:
                raise RuntimeError(f"the clipped sum of {hooks.parameter_name(p)} has {clipped.numel()} elements, the "
                                   f"parameter {spaces[index].numels[param]}: refused")
            sums[(index, param)] = None if clipped is None else clipped.reshape(-1).to(
                device=spaces[index].device, dtype=torch.float32)


def _reduce_scatter(rows: torch.Tensor) -> torch.Tensor:
    """Row ``r`` of the ranks' sum of ``rows``, on rank ``r``."""
    mine = rows.new_empty(rows.shape[1])
    dist = torch.distributed
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(mine, rows.reshape(-1))  # 2.13
    return mine


@torch.no_grad()
def noised_partitions(optimizer: Any, spaces: Sequence[FlatSpace]) -> Iterator[torch.Tensor]:
    """For each space in turn, this rank's partition (``size`` elements, fp32, zero padding) of ``(sum of the ranks'
    clipped sums + noise) / divisor``; the noise of parameter ``k`` of the optimizer is element for element
    ``ShardedNoise``'s stream ``k``, drawn by the rank that owns the element (one small collective: rank 0's key)."""
    rank, world = _rank_and_world()
    noise, std = sharded_noise(optimizer), optimizer.noise_std
    key = noise.step_key() if std > 0 else None
    if key is not None and world > 1:  # one stream: rank 0's key
        box = [key]
        torch.distributed.broadcast_object_list(box, src=0)
        key = int(box[0])
    stream = {p: index for index, p in enumerate(optimizer.params)}
    for space in spaces:
        part = torch.zeros(space.size, dtype=torch.float32, device=space.device)
        for index, param in enumerate(space.params):
            first, last = space.owned(index, rank)
            if last == first or param not in stream:  # not this rank's, or not trained (frozen after initialize)
                continue
            at = space.offsets[index] + first - rank * space.size
            held = optimizer._summed.get(param)
            if held is not None:
                part[at: at + last - first] = held
            if std > 0:
                part[at: at + last - first] += noise.slice(key, stream[param], space.numels[index], first, last, std,
                                                           dtype=part.dtype, device=part.device)
        if optimizer.loss_reduction == "mean":  # the plan's constant divisor (see PrivacyPlan.divisor)
            part /= optimizer.plan.divisor
        yield part


def noise_problems(optimizer: Any) -> List[str]:
    """What of the DP optimizer's noise a partition writer does not draw (empty: none)."""
    if getattr(optimizer.plan, "strategy", None) is not None:
        return ["noise_mechanism='bandmf' keeps its correlated noise state for whole parameters, while under ZeRO "
                "each rank draws only its partition's noise: use noise_mechanism='independent'"]
    return []


__all__ = ["BUCKET", "FlatSpace", "keep_in_partitions", "noise_problems", "noised_partitions"]
