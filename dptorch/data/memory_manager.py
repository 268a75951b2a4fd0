"""Split logical (Poisson) batches into physical batches that fit in memory.

The optimizer must add noise and step once per *logical* batch. The manager tells it which
physical batches close a logical one through ``optimizer.signal_skip_step(do_skip)``, called in
the training process right before each physical batch is handed to the loop, so prefetching
workers cannot desynchronise signals and batches.

Each logical batch is one Poisson draw: when its first physical batch is handed to the loop, the
draw and its size are reported to the ``DPDataLoader`` (which tells the privacy plan), so the
optimizer can check that the physical batches of one step add up to exactly that draw.

Distributed (a ``DPDataLoader(distributed=True)``, or ``distributed=True``): each rank splits
its own shard of every logical batch, so ranks would get different numbers of physical batches
per logical step, and a rank that runs fewer forward/backward passes than another leaves it
waiting in a collective (FSDP2 all-gathers parameters in every forward, DDP with its gradient
sync on reduces in every backward). When the epoch is planned, the ranks agree (one all-reduce of
the per-step counts, MAX) and every rank pads each logical step with empty physical batches up to
the largest count; an empty physical batch adds no sample and no gradient, but it runs forward and
backward like the others. Every rank then has the same number of physical batches per step.

Length: the number of physical batches of a Poisson epoch is random (each draw's size is), so no
formula gives it; it is known once the epoch is drawn. The manager draws all logical index lists
of an epoch from the underlying batch sampler (indices only, cheap) when the epoch's pass starts,
on ``plan_epoch()``, or when ``len()`` is asked between passes, and then splits them; the pass
replays exactly that plan. So ``len()`` is exact: the physical batches of the pass under way, or
of the next one (a progress bar built from it ends at 100%). Drawing early changes no draw and no
accounting: a draw is accounted when its first physical batch is handed to the loop, and a plan
dropped by ``set_epoch`` to another epoch hands nothing out. Distributed, planning is a collective
(the ranks agree on their counts), so ``len()`` cannot plan on one rank alone: there, before the
epoch is planned, it is the estimate ``steps * max(1, ceil(E[batch] / max_physical))``; call
``plan_epoch()`` on every rank first for the exact count.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, List, Optional, Tuple

from torch.utils.data import DataLoader

from dptorch.data import drawn
from dptorch.data.poisson import check_map_style, worker_settings


def split_logical_batch(indices: List[int], max_physical_batch_size: int) -> List[List[int]]:
    """Consecutive chunks of at most ``max_physical_batch_size``; ``[[]]`` for an empty batch."""
    if not indices:
        return [[]]
    size = max_physical_batch_size
    return [list(indices[start : start + size]) for start in range(0, len(indices), size)]


def plan_physical_batches(
    logical_batches: List[List[int]], max_physical_batch_size: int
) -> List[Tuple[List[int], bool]]:
    """``(physical indices, closes_logical_batch)`` for every physical batch, in order."""
    plan = []
    for logical in logical_batches:
        chunks = split_logical_batch(logical, max_physical_batch_size)
        plan.extend((chunk, position == len(chunks) - 1) for position, chunk in enumerate(chunks))
    return plan


def pad_physical_plan(logical_batches: List[List[int]], target_counts: List[int], max_physical_batch_size: int):
    """``plan_physical_batches`` with logical batch ``k`` padded by empty physical batches to
    ``target_counts[k]`` physical batches (the last one still closes the logical batch)."""
    plan = []
    for logical, target in zip(logical_batches, target_counts):
        chunks = split_logical_batch(logical, max_physical_batch_size)
        if target < len(chunks):
            raise ValueError(f"cannot pad {len(chunks)} physical batches down to {target}")
        chunks = chunks + [[] for _ in range(target - len(chunks))]
        plan.extend((chunk, position == len(chunks) - 1) for position, chunk in enumerate(chunks))
    return plan


def agreed_counts(counts: List[int], group: Any = None) -> List[int]:
    """The element-wise maximum of every rank's ``counts`` (physical batches per logical step).

    Refuses ranks that planned different numbers of logical steps (their samplers are out of step:
    different ``steps`` or positions), which would leave one of them waiting in a collective.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(counts)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    length = torch.tensor([len(counts), -len(counts)], dtype=torch.int64, device=device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    if int(length[0]) != -int(length[1]):
        raise RuntimeError(
            f"the ranks planned between {-int(length[1])} and {int(length[0])} logical batches for this epoch "
            f"(this rank: {len(counts)}): their samplers are out of step. Build every rank's DPDataLoader with the "
            "same sample rate and steps, and iterate them the same number of times"
        )
    agreed = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return [int(c) for c in agreed.tolist()]


def estimated_num_physical_batches(num_logical: int, expected_batch_size: float, max_physical_batch_size: int) -> int:
    """``num_logical * max(1, ceil(expected_batch_size / max_physical_batch_size))``."""
    return num_logical * max(1, math.ceil(expected_batch_size / max_physical_batch_size))


class _PlannedBatchSampler:
    """Batch sampler replaying the physical index lists of the current plan."""

    def __init__(self) -> None:
        self.batches: List[List[int]] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[List[int]]:
        return iter(self.batches)


class PhysicalBatchLoader:
    """Iterable of physical batches returned by ``BatchMemoryManager.__enter__``."""

    def __init__(self, data_loader: DataLoader, max_physical_batch_size: int, optimizer: Any,
                 distributed: Optional[bool] = None):
        self.logical_loader = data_loader
        if distributed is None:
            distributed = getattr(data_loader.batch_sampler, "world_size", 1) > 1
        #: Whether every rank pads its logical steps to the same number of physical batches.
        self.distributed = bool(distributed)
        self.max_physical_batch_size = max_physical_batch_size
        self.optimizer = optimizer
        self.dataset = data_loader.dataset
        self._planned = _PlannedBatchSampler()
        self._physical_loader = DataLoader(
            data_loader.dataset,
            batch_sampler=self._planned,
            collate_fn=data_loader.collate_fn,
            **worker_settings(data_loader),
        )
        self._plan: Optional[List[Tuple[List[int], bool]]] = None
        self._opens: List[Optional[Tuple[Optional[int], int]]] = []  # per physical batch: (draw, size) it opens
        self._plan_is_fresh = False
        self._passing = False  # a pass over the current plan is under way
        self._planned_epoch: Optional[int] = None

    def plan_epoch(self) -> int:
        """Draw this epoch's logical batches now (if not already drawn); return the exact len."""
        if not self._plan_is_fresh:
            batch_sampler = self.logical_loader.batch_sampler
            self._planned_epoch = getattr(batch_sampler, "epoch", None)
            if hasattr(batch_sampler, "draws"):  # a Poisson sampler: draws are handed out as they are yielded
                drawn = [(position, list(batch)) for position, batch in batch_sampler.draws()]
            else:
                drawn = [(None, list(batch)) for batch in batch_sampler]
            logical = [batch for _, batch in drawn]
            counts = [len(split_logical_batch(batch, self.max_physical_batch_size)) for batch in logical]
            if self.distributed:
                counts = agreed_counts(counts)
            self._plan = pad_physical_plan(logical, counts, self.max_physical_batch_size)
            self._opens = []
            for (position, batch), chunks in zip(drawn, counts):
                self._opens += [(position, len(batch))] + [None] * (chunks - 1)
            self._plan_is_fresh = True
        return len(self._plan)

    def __len__(self) -> int:
        """The physical batches of the pass under way or of the next one, exact (the next epoch is
        planned now if it is not yet); distributed and not yet planned, an estimate (module docstring)."""
        if self._plan is not None and (self._plan_is_fresh or self._passing):
            return len(self._plan)
        if not self.distributed:
            return self.plan_epoch()
        return estimated_num_physical_batches(
            len(self.logical_loader.batch_sampler), self._expected_batch_size(), self.max_physical_batch_size
        )

    def _expected_batch_size(self) -> float:
        batch_sampler = self.logical_loader.batch_sampler
        expected = getattr(batch_sampler, "expected_batch_size", None)
        if expected is None:
            expected = getattr(batch_sampler, "batch_size", None) or self.max_physical_batch_size
        return float(expected)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the logical batch sampler, unless the pending plan is for ``epoch``."""
        if self._plan_is_fresh and self._planned_epoch == epoch:
            return
        self._plan_is_fresh = False
        batch_sampler = self.logical_loader.batch_sampler
        if hasattr(batch_sampler, "set_epoch"):
            batch_sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        self.plan_epoch()
        self._plan_is_fresh = False
        plan, opens = self._plan, self._opens
        self._planned.batches = [indices for indices, _ in plan]
        hand_out = getattr(self.logical_loader, "hand_out", None)
        batches = iter(self._physical_loader)
        self._passing = True
        handed = None
        try:
            for (_, closes_logical), opened in zip(plan, opens):
                batch = next(batches)
                if opened is not None and hand_out is not None:
                    hand_out(*opened)  # the first physical batch of a logical one: one Poisson draw
                self.optimizer.signal_skip_step(do_skip=not closes_logical)
                handed = drawn.hand_out(batch)
                yield batch
            drawn.hand_out(())  # the pass is over
            handed = None
        finally:
            self._passing = False
            if handed is not None:  # the loop left early (its iterator was closed)
                drawn.let_go(handed)


class BatchMemoryManager:
    """Context manager yielding a loader of physical batches of at most ``max_physical_batch_size``.

    Before each physical batch it calls ``optimizer.signal_skip_step(do_skip=True)``, except
    before the last physical batch of a logical batch, where it calls ``do_skip=False``; so the
    usual loop (``backward(); optimizer.step(); optimizer.zero_grad()``) adds noise and steps
    once per logical batch. An empty logical batch gives one empty physical batch (its step
    still happens). ``data_loader`` is any map-style DataLoader with a batch sampler, typically
    a ``DPDataLoader``. ``len()`` is the exact number of physical batches of the next pass (the
    module docstring says how, and what it is distributed).

    ``distributed`` (default: whether the loader's batch sampler has ``world_size > 1``, as a
    ``DPDataLoader(distributed=True)`` has) pads every rank's logical steps with empty physical
    batches to the same count on all ranks; the loop must run forward and backward on them too.
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer: Any,
                 distributed: Optional[bool] = None):
        if max_physical_batch_size <= 0:
            raise ValueError(f"max_physical_batch_size must be positive, got {max_physical_batch_size}")
        check_map_style(data_loader.dataset)
        if data_loader.batch_sampler is None:
            raise ValueError("data_loader must batch its samples (it has no batch_sampler)")
        if not hasattr(optimizer, "signal_skip_step"):
            raise TypeError("optimizer must provide signal_skip_step(do_skip: bool)")
        if getattr(data_loader, "pads_batches", False):
            raise ValueError(
                f"BatchMemoryManager cannot split the padded batches of a {type(data_loader).__name__}: each of them is "
                "one physical batch of fixed shape whose padding rows only the whole batch identifies. Choose "
                "max_batch_size to fit in memory, or use a FixedSizeDataLoader (no padding) with BatchMemoryManager"
            )
        self.data_loader = data_loader
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.optimizer = optimizer
        self.distributed = distributed

    def __enter__(self) -> PhysicalBatchLoader:
        return PhysicalBatchLoader(self.data_loader, self.max_physical_batch_size, self.optimizer, self.distributed)

    def __exit__(self, exc_type, exc_value, traceback) -> bool:
        return False


__all__ = [
    "BatchMemoryManager",
    "PhysicalBatchLoader",
    "agreed_counts",
    "estimated_num_physical_batches",
    "pad_physical_plan",
    "plan_physical_batches",
    "split_logical_batch",
]
