"""Shuffled fixed-size batches (``make_private(poisson_sampling=False)``), accounted without amplification.

A loader that shuffles the dataset into fixed-size batches gives no subsampling guarantee the
accountants could use (the "amplification" of Poisson sampling), so dptorch accounts it by the one
fact that holds for every order: in one pass over the data, each sample is in exactly one batch.

Under replace-one adjacency (one sample swapped for another, same N) and any order fixed
independently of the data, the swapped sample changes one step of the pass by at most 2C (the
clipped sum loses one clipped gradient and gains another); every other step of the pass is the same
function of the same batch. A pass is therefore one Gaussian mechanism of sensitivity 2C and noise
std ``sigma C``: a Gaussian of noise multiplier ``sigma / 2`` at sample rate 1, which the plan records
once per pass (:meth:`dptorch.plan.PrivacyPlan.record_steps`). Mixing over random orders can only
lower the privacy loss (joint convexity), so the bound holds whoever knows the order: the shuffle
needs no secret randomness, in secure mode or not. A sample rate below 1 is never claimed.

What the bound needs, and how it is enforced:

* the order is independent of the data: only torch's ``SequentialSampler`` and ``RandomSampler``
  without replacement (over at most the dataset) are accepted, under torch's ``BatchSampler``;
* each sample at most once per pass: checked on every batch the sampler yields (a repeat raises);
* one step never holds batches of two passes (a sample could be in it twice): refused at
  ``optimizer.step()`` by the plan's ledger, which learns the pass of every batch handed out;
* every pass is accounted: a pass counts from its first batch handed to the training loop (a pass
  broken off early and a new ``iter()`` both count whole); the count resumes with the plan's state.
"""

from __future__ import annotations

import secrets
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from dptorch.data.poisson import _HandingOutIterator, check_map_style, worker_settings


class RepeatedSampleError(RuntimeError):
    """A pass of a shuffled loader yielded one sample twice: the per-pass accounting would not hold."""


def check_shuffled_source(data_loader: DataLoader) -> None:
    """Refuse a loader whose batches are not disjoint fixed-size batches in a data-independent order."""
    check_map_style(data_loader.dataset)
    size = len(data_loader.dataset)
    if size == 0:
        raise ValueError("the data loader's dataset is empty (0 samples): there is nothing to train on")
    check_single_process()
    problem = permutation_problem(data_loader.batch_sampler, size)
    if problem is not None:
        raise ValueError(problem)


def check_single_process() -> None:
    """Refuse a process group of world size > 1 (at make_private, and at each batch for a group started later)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise ValueError(
            "poisson_sampling=False is not supported under torch.distributed: the per-pass accounting needs every "
            "rank's batches to be disjoint pieces of one pass, which a DistributedSampler does not report. Use "
            "poisson_sampling=True (each rank draws its shard of one Poisson batch)"
        )


#: Element samplers whose pass is a permutation (or a prefix of one) chosen without looking at the data.
_PERMUTATION_SAMPLERS = {(RandomSampler.__module__, "RandomSampler"), (SequentialSampler.__module__, "SequentialSampler"),
                         ("accelerate.data_loader", "SeedableRandomSampler")}  # Accelerate's: a seeded randperm per epoch


def permutation_problem(batch_sampler: Any, size: int) -> Optional[str]:
    """Why ``batch_sampler``'s passes are not disjoint fixed-size batches in a data-independent order
    over ``size`` samples (None when they are): torch's ``BatchSampler`` over a sequential sampler or a
    random one without replacement."""
    if type(batch_sampler) is not BatchSampler:
        return (
            f"poisson_sampling=False takes a DataLoader built with batch_size= (torch's BatchSampler), not one whose "
            f"batches come from a {type(batch_sampler).__name__}: its batches' sizes and membership cannot be "
            "checked. Build it with DataLoader(dataset, batch_size=..., shuffle=True), or use poisson_sampling=True"
        )
    sampler = batch_sampler.sampler
    known = (type(sampler).__module__, type(sampler).__name__) in _PERMUTATION_SAMPLERS
    if known and not (isinstance(sampler, RandomSampler) and (sampler.replacement or sampler.num_samples > size)):
        return None
    what = (f"RandomSampler(replacement={sampler.replacement}, num_samples={sampler.num_samples}) over {size} samples"
            if isinstance(sampler, RandomSampler) else type(sampler).__name__)
    return (
        f"poisson_sampling=False needs each sample at most once per pass, in an order that does not depend on the "
        f"data, but the loader samples with {what}. Use shuffle=True or shuffle=False (torch's RandomSampler "
        "without replacement or SequentialSampler); to train on a subset, pass torch.utils.data.Subset(dataset, "
        "indices) as the dataset; to weigh samples, weigh their losses"
    )


class ShuffledBatchSampler:
    """The batches of a torch ``BatchSampler``, each checked against repeats within its pass.

    Every ``iter()`` is a new pass with a fresh random token (``pass id``, unique across runs, so a
    resumed ledger cannot mistake a new pass for an old one). ``len()`` is the batches per pass.
    """

    sampling = "shuffled"
    world_size, rank = 1, 0

    def __init__(self, batch_sampler: BatchSampler, num_samples: int) -> None:
        self.inner = batch_sampler
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_sampler.batch_size)
        self.steps = len(batch_sampler)
        self._sink: Optional[Deque[Tuple[int, int]]] = None

    def __len__(self) -> int:
        return self.steps

    @property
    def expected_batch_size(self) -> float:
        """The loader's batch size (what ``loss_reduction="mean"`` divides the noised sum by)."""
        return float(self.batch_size)

    @property
    def sample_rate(self) -> float:
        """The fraction of the data in one batch (descriptive only: no subsampling is accounted)."""
        return min(1.0, self.batch_size / self.num_samples)

    def __iter__(self) -> Iterator[List[int]]:
        # A ShuffledDataLoader sets a sink right before building its iterator: the pass and size of each
        # batch go there, and the loader reports them when it yields the batch.
        return self._iterate(self._sink)

    def _iterate(self, sink: Optional[Deque[Tuple[int, int]]]) -> Iterator[List[int]]:
        for pass_id, batch in self.draws():
            if sink is not None:
                sink.append((pass_id, len(batch)))
            yield batch

    def draws(self) -> Iterator[Tuple[int, List[int]]]:
        """One new pass of ``(pass id, indices)``, each batch checked against repeats within the pass
        (what ``BatchMemoryManager`` splits into physical batches)."""
        pass_id = secrets.randbits(62)
        seen = torch.zeros(self.num_samples, dtype=torch.bool)
        for batch in self.inner:
            index = torch.as_tensor(batch, dtype=torch.long)
            if index.numel() and (bool(seen[index].any()) or index.unique().numel() != index.numel()):
                raise RepeatedSampleError(
                    "the data loader's sampler yielded a sample twice in one pass: each pass of shuffled batches is "
                    "accounted as one use of every sample, which would no longer hold. Build the loader with torch's "
                    "RandomSampler without replacement (shuffle=True) or SequentialSampler"
                )
            seen[index] = True
            yield pass_id, list(batch)


class ShuffledDataLoader(DataLoader):
    """A loader of a source loader's dataset, batches and workers that tells the privacy plan of each
    batch it hands out and of the pass it belongs to (see the module docstring)."""

    def __init__(self, source: DataLoader) -> None:
        check_shuffled_source(source)
        batch_sampler = ShuffledBatchSampler(source.batch_sampler, len(source.dataset))
        super().__init__(source.dataset, batch_sampler=batch_sampler, collate_fn=source.collate_fn,
                         **worker_settings(source))
        #: The privacy plan told of every batch handed out (set by ``PrivacyEngine.make_private``).
        self.privacy_plan: Optional[Any] = None
        self.sample_rate = batch_sampler.sample_rate
        self.secure_mode = False
        self._started: set = set()  # passes whose first batch reached the training loop

    @property
    def steps(self) -> int:
        return self.batch_sampler.steps

    def __iter__(self) -> _HandingOutIterator:
        sizes: Deque[Tuple[int, int]] = deque()
        self.batch_sampler._sink = sizes
        try:
            inner = super().__iter__()
        finally:
            self.batch_sampler._sink = None
        # Out-of-order workers may yield batches in another order than the sampler made them (sizes unknown then).
        return _HandingOutIterator(self, inner, sizes, self.num_workers == 0 or getattr(self, "in_order", True))

    def hand_out(self, pass_id: Optional[int], size: Optional[int]) -> None:
        """A batch of pass ``pass_id`` (``size`` samples) reaches the training loop."""
        if self.privacy_plan is None or pass_id is None:
            return
        check_single_process()  # a process group started after make_private is held to the same rule
        first = pass_id not in self._started
        if first:
            self._started.add(pass_id)
        self.privacy_plan.on_draw(size, pass_id=pass_id, new_pass=first)

    def state_dict(self) -> Dict[str, Any]:
        """Nothing to resume: a resumed run starts a new pass (accounted as one)."""
        return {"sampling": "shuffled", "num_samples": self.batch_sampler.num_samples,
                "batch_size": self.batch_sampler.batch_size}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key in ("num_samples", "batch_size"):
            if key in state and state[key] != self.state_dict()[key]:
                raise ValueError(f"the checkpoint's loader has {key}={state[key]}, this one {self.state_dict()[key]}")


__all__ = ["RepeatedSampleError", "ShuffledBatchSampler", "ShuffledDataLoader", "check_shuffled_source", "permutation_problem"]
