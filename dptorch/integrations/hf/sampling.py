"""Poisson sampling for the Trainer: logical batches of units, split into micro-batches.

The accountant needs one Poisson sample of rate ``q`` per optimizer step. The Trainer, though,
counts micro-batches: it steps after every ``gradient_accumulation_steps`` (GA) of them and
trusts ``len(dataloader)``. So each logical batch is drawn once (every unit independently with
probability ``q``) and dealt, unit by unit, into exactly GA micro-batches, possibly empty. The
Trainer's arithmetic is then exact: ``len = steps * GA``, one optimizer step per logical batch.

A unit's rows always land in one micro-batch, because clipping happens after every backward
pass: a unit split across two passes would be clipped twice and contribute up to 2C.

An empty micro-batch reaches the Trainer as :class:`EmptyBatch` (an empty ``dict``), never as a
call of the user's collator on ``[]``; on one process the private trainer skips its forward and
backward, on several it runs a phantom that adds and counts nothing (:mod:`.phantom`), and the
optimizer step still adds the noise.

Distributed (``torchrun`` / ``accelerate launch``, DDP or FSDP2): the logical batch is global. Its expected
size is ``per_device_train_batch_size * gradient_accumulation_steps * world_size`` units, so
``q = that / num_units``; rank ``r`` owns units ``r::world_size`` and keeps its part of each draw
(all ranks use the same secret seed, so the parts are disjoint pieces of one Poisson batch; in
secure mode each rank draws its own units from the OS CSPRNG). Every rank then deals its part into
the same ``gradient_accumulation_steps`` micro-batches, so all ranks take the same number of
micro-batches and optimizer steps; no sample is dealt to two ranks, and none is repeated to even
out the ranks (Accelerate's ``even_batches`` would re-yield used batches).

Banded matrix-factorisation noise (``noise_mechanism="bandmf"``, ``bands=b``) needs b-min-separated
sampling: with ``bands`` the logical batches come from a
:class:`~dptorch.data.cyclic_poisson.CyclicPoissonBatchSampler` over the units (b fixed partitions
of the units, draw ``t`` Poisson-samples partition ``t mod b`` at the partition rate q_p), dealt
into micro-batches in the same way. A unit lives in one partition, so all its rows do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from dptorch.data.cyclic_poisson import CyclicPoissonBatchSampler, partitions
from dptorch.data.poisson import PoissonBatchSampler
from dptorch.grad_sample.units.token_units import units_from_position_ids
from dptorch.integrations.hf.units import PrivacyUnits

#: Batch key carrying the privacy unit of each example (removed before the model sees the batch).
UNIT_IDS_KEY = "dp_unit_ids"


class EmptyBatch(dict):
    """The micro-batch that Poisson sampling left empty; has no keys."""


def is_empty_batch(batch: Any) -> bool:
    return isinstance(batch, EmptyBatch) or (isinstance(batch, dict) and len(batch) == 0)


class PoissonMicroBatchSampler:
    """Batch sampler yielding ``micro_batches`` micro-batches (row index lists) per logical batch.

    Each logical batch includes every unit independently with probability ``sample_rate``;
    ``steps`` logical batches make an epoch. Logical batch ``k`` is a function of ``(seed, k)``
    and the sampler never draws a position twice (see ``PoissonBatchSampler``): ``set_epoch(e)``
    moves forward to epoch ``e``, which is how a resumed Trainer, in a new sampler, reaches the
    epoch it stopped in and then skips the batches it already trained on. ``secure=True`` draws
    every logical batch from the OS CSPRNG instead (nothing replayable). There is no ``.sampler``
    attribute, so Accelerate leaves the sampler as it is.

    ``bands=b`` (bandmf): logical batch ``t`` Poisson-samples partition ``t mod b`` of the units at
    the partition rate ``sample_rate`` (a :class:`CyclicPoissonBatchSampler`; ``partition_seed``
    fixes the partitions, default the seed); ``steps`` must be a multiple of b.
    """

    def __init__(
        self, units: PrivacyUnits, sample_rate: float, *, steps: int, micro_batches: int, seed: Optional[int] = None,
        secure: bool = False, rank: int = 0, world_size: int = 1, bands: Optional[int] = None,
        partition_seed: Optional[int] = None,
    ) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.units = units
        self.micro_batches = int(micro_batches)
        #: Called as each micro-batch is yielded: with the rows of the logical draw it opens (its first
        #: micro-batch), None for the others (see ``PoissonBatchSampler.listener``).
        self.listener: Optional[Callable[[Optional[int]], None]] = None
        options = dict(steps=steps, seed=seed, secure=secure, rank=rank, world_size=world_size)
        if bands is None:
            self.logical = PoissonBatchSampler(units.num_units, sample_rate, **options)
        else:
            self.logical = CyclicPoissonBatchSampler(units.num_units, sample_rate, bands=bands,
                                                     partition_seed=partition_seed, **options)

    @property
    def bands(self) -> Optional[int]:
        """The partitions of cyclic Poisson sampling (bandmf), None for plain Poisson sampling."""
        return getattr(self.logical, "bands", None)

    @property
    def sample_rate(self) -> float:
        return self.logical.sample_rate

    @property
    def steps(self) -> int:
        """Logical batches (optimizer steps) per epoch."""
        return self.logical.steps

    @property
    def seed(self) -> Optional[int]:
        return self.logical.seed

    @seed.setter
    def seed(self, value: int) -> None:
        if not self.logical.secure:
            self.logical.seed = int(value)

    def set_partition_seed(self, value: int) -> None:
        """bandmf: the partitions of the run being resumed (a function of their seed); no-op for Poisson sampling."""
        if self.bands is not None and int(value) != self.logical.partition_seed:
            self.logical.partition_seed = int(value)
            self.logical.partitions = partitions(self.units.num_units, self.bands, int(value))

    @property
    def position(self) -> int:
        """Logical batches drawn so far (the next draw's index)."""
        return self.logical.position

    def start_at(self, position: int) -> None:
        """Continue from draw ``position`` (of an earlier sampler of the same run): no draw is repeated."""
        self.logical._position = max(self.logical._position, int(position))

    def rewind(self) -> None:
        """Back to draw 0, for a resume from a checkpoint (whose accountant forgets later draws)."""
        self.logical._position = self.logical._handed_out = 0

    def __len__(self) -> int:
        return self.logical.steps * self.micro_batches

    def set_epoch(self, epoch: int) -> None:
        self.logical.set_epoch(epoch)

    def __iter__(self) -> Iterator[List[int]]:
        for logical_units in self.logical:
            groups = [self.units.rows_of(group)
                      for group in np.array_split(np.asarray(logical_units, dtype=np.int64), self.micro_batches)]
            for index, rows in enumerate(groups):
                if self.listener is not None:  # the draw's rows with its first micro-batch, None with the others
                    self.listener(sum(map(len, groups)) if index == 0 else None)
                yield rows


class IndexedDataset(Dataset):
    """``dataset`` whose items come with their row index: ``(index, item)``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return index, self.dataset[index]

    def __getitems__(self, indices: List[int]) -> List[Any]:
        fetch = getattr(self.dataset, "__getitems__", None)
        items = fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]
        return list(zip(indices, items))


class PrivateCollate:
    """Wraps a collator: ``[]`` becomes :class:`EmptyBatch`; with ``unit_of_row``, items are
    ``(index, item)`` pairs and the batch gains ``UNIT_IDS_KEY`` (one unit id per item).

    The collated batch must hold the drawn examples as drawn (``rows_per_example`` rows each), or say
    which tokens belong to which (``packed_units``): a collator that merges examples into rows would
    otherwise make the whole micro-batch one privacy unit while the accounting counts examples.
    """

    def __init__(self, collate_fn: Callable[[List[Any]], Any], unit_of_row: Optional[np.ndarray] = None,
                 rows_per_example: int = 1) -> None:
        self.collate_fn = collate_fn
        self.unit_of_row = unit_of_row
        self.rows_per_example = rows_per_example

    def __call__(self, items: List[Any]) -> Any:
        if len(items) == 0:
            return EmptyBatch()
        if self.unit_of_row is None:
            return packed_units(self.collate_fn(items), len(items), self.rows_per_example)
        indices = [index for index, _ in items]
        batch = self.collate_fn([item for _, item in items])
        if not isinstance(batch, dict) and not hasattr(batch, "keys"):
            raise TypeError(
                f"privacy units need the collator to return a dict of tensors, got {type(batch).__name__}"
            )
        if batch.get(UNIT_IDS_KEY) is not None:
            raise ValueError("privacy_unit_column cannot be combined with a collator that packs examples into rows")
        batch[UNIT_IDS_KEY] = torch.as_tensor(self.unit_of_row[indices], dtype=torch.long)
        return packed_units(batch, len(items), self.rows_per_example)


def packed_units(batch: Any, examples: int, rows_per_example: int = 1) -> Any:
    """``batch`` if its rows are the ``examples`` drawn (``rows_per_example`` each) or its per-token unit ids
    (``UNIT_IDS_KEY``, 2-D) name at most that many examples; a batch of examples merged into rows with
    ``position_ids`` that restart at 0 for each example (``DataCollatorWithFlattening``) gains those ids. Any
    other merging of examples is refused."""
    if not (isinstance(batch, dict) or hasattr(batch, "keys")):
        return batch
    units = batch.get(UNIT_IDS_KEY)
    if isinstance(units, torch.Tensor) and units.dim() == 2:
        named = torch.unique(units[units >= 0])
        if named.numel() and int(named.max()) >= examples:
            raise ValueError(f"the collator's {UNIT_IDS_KEY} name units outside 0..{examples - 1}, the examples drawn")
        return batch
    rows = next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), None)
    if rows is None or rows == examples * rows_per_example or units is not None:
        return batch
    positions = batch.get("position_ids")
    if rows_per_example == 1 and isinstance(positions, torch.Tensor) and positions.dim() == 2:
        ids = units_from_position_ids(positions, batch.get("attention_mask"))
        if int(ids.max()) + 1 == examples:
            batch[UNIT_IDS_KEY] = ids
            return batch
    raise ValueError(
        f"the collator turned {examples} drawn examples into {rows} rows: it merges examples, so a row would be "
        "several privacy units clipped as one. Use a collator that keeps one example per row, pack with "
        "dptorch.integrations.hf.packing.PackingCollator (or TRL's packing=True), or give position_ids that "
        "restart at 0 for every example."
    )


@dataclass(frozen=True)
class SamplingPlan:
    """Sampling rate and step counts of a run, as the Trainer will count them.

    A logical batch holds ``per_device_train_batch_size * gradient_accumulation_steps *
    world_size`` units on average (the Trainer's total train batch size): ``q = that / num_units``;
    an epoch is ``ceil(num_units / that)`` logical batches.

    ``bands=b`` (bandmf, cyclic Poisson sampling): a logical batch samples one of b partitions, so
    ``sample_rate`` is the partition rate ``q_p = b * that / num_units`` (the rate the accounting
    uses) and an epoch is ``b * ceil(num_units / (b * that))`` logical batches (a multiple of b).
    """

    num_units: int
    sample_rate: float
    steps_per_epoch: int
    micro_batches: int
    total_steps: int
    bands: int = 1

    @property
    def expected_batch_size(self) -> float:
        """Expected units per logical batch, ``q * num_units / bands`` (the DP optimizer divides by it)."""
        return self.sample_rate * self.num_units / self.bands

    @classmethod
    def for_training(
        cls,
        *,
        num_units: int,
        batch_size: int,
        gradient_accumulation_steps: int,
        max_steps: int,
        num_train_epochs: float,
        world_size: int = 1,
        bands: Optional[int] = None,
    ) -> "SamplingPlan":
        if num_units <= 0:
            raise ValueError("the training dataset is empty: there is nothing to sample")
        b = 1 if bands is None else int(bands)
        if b > num_units:
            raise ValueError(f"bands={b} cannot split {num_units} privacy units into {b} non-empty partitions")
        logical = batch_size * gradient_accumulation_steps * max(1, int(world_size))
        steps_per_epoch = b * max(1, math.ceil(num_units / (b * logical)))
        total = max_steps if max_steps > 0 else math.ceil(num_train_epochs * steps_per_epoch)
        return cls(num_units, min(1.0, b * logical / num_units), steps_per_epoch, gradient_accumulation_steps, total,
                   b)
