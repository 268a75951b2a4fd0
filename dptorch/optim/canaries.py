"""Gradient canaries: known extra privacy units inside a real private run, for the one-run audit.

``m`` canaries live in the space of the DP optimizer's trainable parameters (flattened in the
optimizer's order). Canary ``i`` has a unit direction ``u_i``: a **Dirac** canary one coordinate
(a different one per canary), a **random** canary a Gaussian direction over every trainable
element. Each canary is in the run independently with probability 1/2 (``included``, drawn once).
At every logical step each included canary is Poisson-sampled with the plan's sample rate ``q``,
like every unit of the user's data, and a sampled one adds its gradient ``scale * C * u_i``,
clipped by the optimizer's own rule (:meth:`DPOptimizer.unit_factors`: exactly ``C u_i`` under
flat clipping), to the clipped sum before the noise. After the noise, ``scores[i]`` grows by
``<u_i, noised sum>`` (the privatised gradient times the plan's divisor under
``loss_reduction="mean"``): the white-box auditor's view of what the step released.

Accounting: the canaries are privacy units of the run's dataset, which then has ``N + m`` units.
The accountant's epsilon for Poisson-subsampled Gaussian steps depends on ``q``, the noise
multiplier and the steps, not on the number of units, so it holds for each of the ``N + m`` units,
data and canaries alike (delta must then be below ``1 / (N + m)``). The plan's divisor stays
``q N`` (a constant: post-processing). The canaries' draws come from their own generator,
independent of the data and of the noise: for a unit of the user's data the canaries' sum is a
data-independent shift, so its guarantee is the same as without them.

Where each rank holds a parameter's clipped sum (:class:`_Piece`): whole parameters on every rank (one
process, DDP, and the parameters FSDP2 leaves unsharded) take the canaries on rank 0 only, once into the
all-reduced sum; an FSDP2 (or HSDP) shard takes exactly its slice of each sampled canary on the rank that
holds it (under HSDP on the ranks of replica 0, as the noise), so the sum over the ranks is one canary. The
draws are the same on every rank (rank 0's seed). A score sums each rank's dot product over the elements it
holds, all-reduced over the shard group: every rank has the same scores. Tensor-parallel slices and DeepSpeed
partitions are refused.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from dptorch.distributed.fsdp import ShardedParameters, is_sharded, shard_layouts
from dptorch.noise.gaussian import secure_seed
from dptorch.optim.gradient_writer import WholeParameters

CANARY_KINDS = ("dirac", "random")
#: Largest ``m * D`` for random canaries (their directions are kept: 4 bytes each).
MAX_RANDOM_ELEMENTS = 1 << 26


class CanaryError(ValueError):
    """A run that gradient canaries cannot audit soundly (refused before any step)."""


@dataclass(frozen=True)
class _Piece:
    """The part of one parameter's clipped sum this rank holds: elements ``[start, end)`` of the flattened full
    parameter, kept in ``shape`` on ``device``."""

    start: int
    end: int
    shape: Tuple[int, ...]
    device: torch.device
    adds: bool  # whether this rank adds the canaries' slice here (one rank per element over the whole run)
    group: Any = None  # the shard group holding the other pieces (scores all-reduced over it); None: whole here


class GradientCanaries:
    """The canaries of one DP optimizer's run; build with :meth:`attach`."""

    def __init__(self, params: List[torch.nn.Parameter], num_canaries: int, *, sample_rate: float,
                 kind: str = "dirac", seed: Optional[int] = None, scale: float = 10.0, rank: int = 0,
                 pieces: Optional[List[_Piece]] = None) -> None:
        if not (isinstance(num_canaries, int) and num_canaries >= 2):
            raise CanaryError(f"audit canaries: the number of canaries must be a whole number >= 2, got {num_canaries!r}")
        if kind not in CANARY_KINDS:
            raise CanaryError(f"audit canaries: kind must be one of {CANARY_KINDS}, got {kind!r}")
        if not (scale >= 1 and math.isfinite(scale)):
            raise CanaryError(f"audit canaries: scale must be a finite number >= 1, got {scale!r}")
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        if kind == "dirac" and num_canaries > total:
            raise CanaryError(f"audit canaries: {num_canaries} Dirac canaries need as many trainable elements, "
                              f"the optimizer has {total}")
        if kind == "random" and num_canaries * total > MAX_RANDOM_ELEMENTS:
            raise CanaryError(f"audit canaries: {num_canaries} random canaries over {total:,} trainable elements would "
                              f"keep {num_canaries * total:,} floats; use kind='dirac' (one coordinate each)")
        self.num_canaries, self.kind, self.scale, self.sample_rate = num_canaries, kind, float(scale), float(sample_rate)
        self.seed = int(secure_seed() if seed is None else seed)
        #: Per parameter, the part of its clipped sum this rank holds (default: whole, added on rank 0).
        self._pieces = pieces or [_Piece(0, p.numel(), tuple(p.shape), p.device, rank == 0) for p in params]
        self._generator = torch.Generator().manual_seed(_stream_seed(self.seed))
        #: Whether each canary is in the run (drawn once, probability 1/2).
        self.included = torch.rand(num_canaries, generator=self._generator) < 0.5
        #: Each canary's sum over steps of its alignment with the noised sum.
        self.scores = torch.zeros(num_canaries, dtype=torch.float64)
        #: Steps observed, and the times each canary was added (sampled while included).
        self.steps = 0
        self.times_added = torch.zeros(num_canaries, dtype=torch.int64)
        self._params = list(params)
        device = params[0].device
        if kind == "dirac":
            self._blocks = _dirac_blocks(_distinct_coordinates(total, num_canaries, self._generator), sizes, device)
            #: The blocks' coordinates this rank holds, as flat indices into its pieces.
            self._local_blocks = _local_blocks(self._blocks, self._pieces)
            self._directions: Optional[torch.Tensor] = None
        else:
            directions = torch.randn(num_canaries, total, generator=self._generator)
            self._directions = (directions / directions.norm(dim=1, keepdim=True)).to(device)
            self._blocks, self._local_blocks = [], []
        #: Each piece's columns in the flat parameter space (random canaries' directions).
        self._offsets = [0, *itertools.accumulate(sizes)][:-1]

    # ------------------------------------------------------------------ building

    @classmethod
    def attach(cls, optimizer: Any, num_canaries: int, *, kind: str = "dirac", seed: Optional[int] = None,
               scale: float = 10.0) -> "GradientCanaries":
        """Canaries for ``optimizer`` (a :class:`~dptorch.optim.DPOptimizer`): added before the noise of every
        step from now on, scored after it. Refused (``CanaryError``) where the audit would not be sound."""
        check_auditable(optimizer)
        if getattr(optimizer, "canaries", None) is not None:
            raise CanaryError("audit canaries: this optimizer already has canaries")
        canaries = cls(optimizer.params, num_canaries, sample_rate=optimizer.plan.sample_rate, kind=kind,
                       seed=_seed_of_rank_zero(seed), scale=scale, rank=optimizer._rank, pieces=_pieces(optimizer))
        optimizer.canaries = canaries
        optimizer.attach_step_hook(canaries.observe)
        return canaries

    # ------------------------------------------------------------------ one step

    def add_to_sums(self, optimizer: Any) -> None:
        """Draw this step's canaries and add each sampled one's clipped gradient to the optimizer's clipped sums
        (each element on the one rank whose piece adds it); called by the optimizer before the noise."""
        check_auditable(optimizer)
        params = optimizer.params
        if len(params) != len(self._params) or any(a is not b for a, b in zip(params, self._params)):
            raise CanaryError("audit canaries: the optimizer's trainable parameters changed since the canaries were "
                              "placed (parameters replaced, e.g. by a sharding wrapper); the audit cannot follow them")
        sampled = self.included & (torch.rand(self.num_canaries, generator=self._generator) < self.sample_rate)
        self.times_added += sampled.long()  # the same draws on every rank: rank 0's seed
        if not bool(sampled.any()) or not any(piece.adds for piece in self._pieces):
            return
        raw = torch.full((self.num_canaries,), self.scale * _bound(optimizer))
        strength = (optimizer.unit_factors(raw) * raw).to(torch.float64) * sampled  # each canary's clipped norm
        if self.kind == "dirac":
            for index, local, canary in self._local_blocks:
                if self._pieces[index].adds:
                    _add_to_sum(optimizer, self._params[index], self._pieces[index], local, strength[canary])
        else:
            flat = strength.to(self._directions.device, torch.float32) @ self._directions
            for p, piece, offset in zip(self._params, self._pieces, self._offsets):
                if piece.adds:  # this rank's slice of every sampled canary, once over the ranks
                    part = flat[offset + piece.start:offset + piece.end]
                    _add_to_sum(optimizer, p, piece, torch.arange(part.numel(), device=part.device), part)

    def observe(self, optimizer: Any) -> None:
        """After the noise: ``scores[i] += <u_i, privatised gradient> * divisor`` (a step hook); over shards, each
        rank's dot product on the elements it holds, all-reduced over the shard group (the same on every rank)."""
        divisor = float(optimizer.plan.divisor) if optimizer.loss_reduction == "mean" else 1.0
        grads = [_local_grad(p, piece) for p, piece in zip(self._params, self._pieces)]
        partial: Dict[Any, torch.Tensor] = {}  # per shard group (None: whole parameters), in the parameters' order
        for piece in self._pieces:
            partial.setdefault(piece.group, torch.zeros(self.num_canaries, dtype=torch.float64))
        if self.kind == "dirac":
            for index, local, canary in self._local_blocks:
                values = grads[index][local.to(grads[index].device)].to("cpu", torch.float64)
                partial[self._pieces[index].group].index_add_(0, canary, values)
        else:
            for group in partial:
                columns = [(offset + piece.start, grad) for piece, offset, grad in zip(self._pieces, self._offsets, grads)
                           if piece.group is group]
                flat = torch.zeros(self._directions.shape[1], dtype=torch.float32, device=self._directions.device)
                for start, grad in columns:
                    flat[start:start + grad.numel()] = grad.to(flat.device, torch.float32)
                partial[group] += (self._directions @ flat).to("cpu", torch.float64)
        for group, values in partial.items():
            if group is not None:
                torch.distributed.all_reduce(values, group=group)
            self.scores += values * divisor
        self.steps += 1

    # ------------------------------------------------------------------ what the audit reads

    def summary(self) -> Dict[str, Any]:
        """The canaries' settings, for a report."""
        return {"num_canaries": self.num_canaries, "num_included": int(self.included.sum()), "kind": self.kind,
                "scale": self.scale, "sample_rate": self.sample_rate, "steps": self.steps}


def check_auditable(optimizer: Any) -> None:
    """Refuse a run whose canaries could not be accounted or added as the audit assumes."""
    plan = optimizer.plan
    problems = []
    if plan.sampling != "poisson" or not plan.sample_rate:
        problems.append("the run is not Poisson-sampled at a known rate (the canaries are sampled as its units are)")
    if getattr(plan, "strategy", None) is not None:
        problems.append("bandmf noise (correlated over steps, cyclic sampling): the canaries would need its sampling")
    if plan.clipping not in ("flat", "automatic"):
        problems.append(f"clipping={plan.clipping!r}: canaries are clipped as whole units (flat or automatic "
                        "clipping); per-layer and adaptive clipping are not supported")
    if plan.counts_unclipped:
        problems.append("a released count of unclipped units (clipping_stats='private'): the canaries would count too")
    if type(optimizer.gradient_writer) not in (WholeParameters, ShardedParameters):
        problems.append(f"the clipped sums are kept by {type(optimizer.gradient_writer).__name__} (tensor-parallel "
                        "slices or DeepSpeed partitions); canaries need whole parameters or FSDP2 (HSDP) shards "
                        "(one process, DDP or fully_shard)")
    if problems:
        raise CanaryError("audit canaries refused: " + "; ".join(problems))


def _bound(optimizer: Any) -> float:
    """The flat clipping bound C (1: automatic clipping's sensitivity)."""
    return float(optimizer.plan.max_grad_norm) if optimizer.plan.clipping == "flat" else 1.0


def _distinct_coordinates(total: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct coordinates of ``range(total)``, uniformly, in random order (no permutation of all)."""
    if count * 4 >= total:
        return torch.randperm(total, generator=generator)[:count]
    chosen = torch.zeros(0, dtype=torch.int64)
    while chosen.numel() < count:
        draws = torch.randint(total, (2 * count,), generator=generator)
        merged = torch.cat([chosen, draws])
        chosen = merged[_first_occurrences(merged)]
    return chosen[:count]


def _first_occurrences(values: torch.Tensor) -> torch.Tensor:
    """The index of each distinct value's first occurrence, in increasing order."""
    unique, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((unique.numel(),), values.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(values.numel()), reduce="amin")
    return first.sort().values


def _dirac_blocks(coordinates: torch.Tensor, sizes: List[int], device: torch.device) -> list:
    """Per parameter holding canaries: (parameter index, local flat indices on its device, canary indices)."""
    blocks, start = [], 0
    for index, size in enumerate(sizes):
        inside = ((coordinates >= start) & (coordinates < start + size)).nonzero().reshape(-1)
        if inside.numel():
            blocks.append((index, (coordinates[inside] - start).to(device), inside))
        start += size
    return blocks


def _local_blocks(blocks: list, pieces: List[_Piece]) -> list:
    """The Dirac blocks restricted to the elements this rank holds: (parameter index, flat indices into the
    piece, canary indices on the CPU)."""
    local = []
    for index, coordinates, canary in blocks:
        piece = pieces[index]
        coordinates = coordinates.cpu()
        inside = ((coordinates >= piece.start) & (coordinates < piece.end)).nonzero().reshape(-1)
        if inside.numel():
            local.append((index, (coordinates[inside] - piece.start).to(piece.device), canary.cpu()[inside]))
    return local


def _pieces(optimizer: Any) -> List[_Piece]:
    """What this rank holds of each trainable parameter's clipped sum: an FSDP2 (HSDP) shard's rows, added on
    the ranks of replica 0 (the ranks that add its noise), or the whole parameter, added on rank 0."""
    pieces = []
    sharded = isinstance(optimizer.gradient_writer, ShardedParameters)
    for p in optimizer.params:
        if sharded and is_sharded(p):
            layout = shard_layouts(optimizer, [p])[p]
            start, end = layout.element_range
            pieces.append(_Piece(start, end, layout.local_shape, p.to_local().device, layout.replica == 0, layout.group))
        else:
            pieces.append(_Piece(0, p.numel(), tuple(p.shape), p.device, optimizer._rank == 0))
    return pieces


def _local_grad(param: torch.nn.Parameter, piece: _Piece) -> torch.Tensor:
    """The flat privatised gradient of ``piece`` (this rank's shard of a DTensor gradient; zeros where none)."""
    grad = param.grad
    if grad is None:
        return torch.zeros(piece.end - piece.start, dtype=torch.float32, device=piece.device)
    grad = grad.to_local() if is_sharded(grad) else grad
    return grad.detach().reshape(-1)


def _add_to_sum(optimizer: Any, param: torch.nn.Parameter, piece: _Piece, local: torch.Tensor,
                values: torch.Tensor) -> None:
    """``optimizer._summed[param]`` (this rank's ``piece`` of it) plus ``values`` at the flat indices ``local`` (a
    new tensor: a held sum may share memory with another)."""
    held = optimizer._summed.get(param)
    if held is None:
        held = torch.zeros(piece.shape, dtype=torch.float32, device=piece.device)
    flat = held.reshape(-1).index_add(0, local.to(held.device), values.to(held.device, held.dtype))
    optimizer._summed[param] = flat.view(held.shape)


def _stream_seed(seed: int) -> int:
    """The canaries' generator seed: ``seed`` mixed (a golden-ratio multiply), so that ``audit_seed`` equal to a
    ``noise_seed`` still gives a stream apart from the noise's (canary draws correlated with the noise would
    make the noise non-Gaussian for the data's units)."""
    return (int(seed) * 0x9E3779B97F4A7C15 + 0x5A0D17) % (1 << 63)


def _seed_of_rank_zero(seed: Optional[int]) -> int:
    """``seed`` (or a secret one) as rank 0 has it, on every rank of the default process group."""
    value = secure_seed() if seed is None else int(seed)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = int(box[0])
    return value


__all__ = ["CANARY_KINDS", "CanaryError", "GradientCanaries", "check_auditable"]
