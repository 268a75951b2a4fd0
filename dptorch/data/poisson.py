"""Poisson subsampling for DP-SGD.

The privacy analysis of DP-SGD (the subsampled Gaussian mechanism) assumes that every batch
includes each sample independently with probability ``q``. Batch sizes are therefore random
(Binomial(N, q)) and may be zero. This module provides a batch sampler with that law and a
``DataLoader`` built on it whose empty batches keep the structure of normal ones.

Every draw is fresh: the sampler never hands out the same draw twice, whatever the iteration
pattern (see ``PoissonBatchSampler``), and the loader tells the privacy plan (``dptorch.plan``) of
each batch it hands to the training loop, so the optimizer can check that one draw feeds one step.

Sampling randomness should stay secret from whoever sees the trained model; seeding it (for
reproducibility or resumption) is fine as long as the seed is not published. ``secure=True``
draws the inclusion bits from the secure stream (AES-256-CTR keyed from the OS CSPRNG).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from dptorch.data import drawn
from dptorch.noise import secure_bernoulli

_MASK64 = (1 << 64) - 1

# DataLoader settings that a rebuilt loader inherits from the original one.
_WORKER_SETTINGS = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)

_ITERABLE_DATASET_ERROR = (
    "Poisson sampling needs random access to the dataset (each sample is included "
    "independently in each batch), but got an IterableDataset. Convert it to a map-style "
    "dataset first (one with __getitem__ and __len__): e.g. materialise it with "
    "`list(iterable_dataset)`, or for a HuggingFace streaming dataset load it without "
    "`streaming=True`."
)


def draw_seed(seed: int, position: int) -> int:
    """The 64-bit seed of draw number ``position`` derived from ``seed`` (SplitMix64 finaliser)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


#: The earlier name of ``draw_seed`` (the first draw's seed is ``epoch_seed(seed, 0)``).
epoch_seed = draw_seed


def default_steps(sample_rate: float) -> int:
    """Number of batches in one epoch: round(1/q), at least 1."""
    return max(1, round(1.0 / sample_rate))


class PoissonBatchSampler:
    """Yields batches (lists of indices), each including every index independently with prob. ``q``.

    ``len()`` is ``steps`` (default ``round(1/q)``): an epoch is ``steps`` consecutive draws, and a
    pass started at the beginning of an epoch yields exactly that many batches, some possibly
    empty. There is deliberately no ``.sampler`` attribute (Accelerate would replace a
    ``RandomSampler`` found there).

    Every draw is fresh. The sampler keeps one position, the index of its next draw, shared by all
    its iterators, and never moves it back: a new iterator started before an epoch ends, partial
    passes and several live iterators all take new draws (a pass ends at the next epoch boundary,
    so an interrupted epoch is completed, not restarted). Reusing a batch would be a second query
    of the same sample set that the accountant, which assumes independent Poisson draws, never
    sees.

    Randomness: draw ``k`` is a function of ``(seed, k)`` (``draw_seed``), so a run resumed from
    ``state_dict()`` continues with exactly the draws the original would have made. ``seed``
    defaults to one taken from ``generator`` if given, else from torch's global RNG (so
    ``torch.manual_seed`` makes runs reproducible). ``secure=True`` takes every inclusion bit from
    the secure stream (``dptorch.noise.secure_bernoulli``: AES-256-CTR under a key from the OS CSPRNG,
    a word below ``ceil(q 2^64)``) instead: nothing can be replayed, not even by
    whoever knows torch's seed; a resumed secure sampler keeps its position and draws fresh batches.

    Epochs: ``epoch`` is ``position // steps``. ``set_epoch(e)`` moves the position forward to the
    start of epoch ``e`` (skipped draws are never drawn, which costs no privacy); it never moves it
    back, so ``set_epoch`` of a past or the current epoch is a no-op and cannot replay batches.

    Distributed: rank ``r`` of ``world_size`` draws the full mask and keeps indices
    ``r::world_size``. With the same seed on all ranks the shards are disjoint pieces of one
    Poisson batch over the whole dataset; with different seeds (or ``secure=True``) each index is
    still included independently with probability ``q``. Either way the global batch is Poisson
    with rate q.

    Checkpointing: ``state_dict()`` holds the seed and the position after the last batch handed to
    the training loop. A ``DPDataLoader`` reports which batches it handed out, so batches that its
    workers prefetched but the loop never saw are drawn again after a resume, exactly as the
    uninterrupted run would have used them.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        *,
        steps: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        seed: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        secure: bool = False,
    ):
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if steps is not None and steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if generator is not None and generator.device.type != "cpu":
            raise ValueError("the sampling generator must be a CPU torch.Generator")
        if secure and (seed is not None or generator is not None):
            raise ValueError(
                "secure sampling draws every batch from the OS CSPRNG and takes no seed or generator; remove "
                "them, or use secure=False for a replayable (seeded) sampler"
            )
        if not secure and seed is None:
            seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64, generator=generator).item())
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps = default_steps(sample_rate) if steps is None else int(steps)
        self.secure = bool(secure)
        self.seed = None if secure else int(seed) & _MASK64
        self.generator = torch.Generator()  # reseeded from (seed, position) for every draw
        self.rank = int(rank)
        self.world_size = int(world_size)
        self._position = 0  # index of the next draw
        self._handed_out = 0  # position after the last batch handed to the training loop
        self._sink: Optional[Deque[Tuple[int, int]]] = None
        #: Called with each batch's size as the sampler yields it (which may be ahead of the training loop,
        #: in a loader's prefetch): how a loop that cannot wrap the loader (the plain-Trainer callback) learns
        #: of the draws in the order the loop will train on them.
        self.listener: Optional[Callable[[Optional[int]], None]] = None
        #: Tensor parallelism: the process group whose ranks all train on one batch; every draw is then
        #: its rank 0's, broadcast (``mirror_draws``), secure draws included.
        self.mirror: Any = None

    def __len__(self) -> int:
        return self.steps

    @property
    def position(self) -> int:
        """Index of the next draw (draws so far, including skipped ones)."""
        return self._position

    @property
    def epoch(self) -> int:
        """The epoch of the next draw: ``position // steps``."""
        return self._position // self.steps

    @property
    def shard_size(self) -> int:
        """Number of indices this rank samples from."""
        return len(range(self.rank, self.num_samples, self.world_size))

    @property
    def expected_batch_size(self) -> float:
        """Expected number of indices per batch on this rank: q * shard_size."""
        return self.sample_rate * self.shard_size

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at epoch ``epoch`` if it lies ahead; never goes back (no replay)."""
        start = int(epoch) * self.steps
        if start > self._position:
            self._position = start
            self._handed_out = max(self._handed_out, start)

    def draw(self) -> Tuple[int, List[int]]:
        """Take the next draw: ``(its position, the indices of this rank)``."""
        position = self._position
        self._position += 1
        if self.secure:
            if self.world_size > 1:
                mask = torch.from_numpy(secure_bernoulli(self.shard_size, self.sample_rate))
            else:
                mask = torch.from_numpy(secure_bernoulli(self.num_samples, self.sample_rate))
        else:
            self.generator.manual_seed(draw_seed(self.seed, position))
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            if self.world_size > 1:
                mask = mask[self.rank :: self.world_size]
        local = mask.nonzero().flatten()
        indices = (local * self.world_size + self.rank).tolist()
        if self.mirror is not None:  # one batch for the whole tensor-parallel group: rank 0's
            import torch.distributed as dist

            box = [indices]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.mirror, 0), group=self.mirror)
            indices = list(box[0])
        return position, indices

    def draws(self) -> Iterator[Tuple[int, List[int]]]:
        """One pass of ``(position, indices)``, up to the next epoch boundary, not marked as handed out.

        The caller reports each batch it hands to the training loop with ``hand_out(position)``.
        """
        end: Optional[int] = None
        while True:
            if end is None:
                end = (self._position // self.steps + 1) * self.steps
            if self._position >= end:
                return
            yield self.draw()

    def hand_out(self, position: int) -> None:
        """Record that the batch drawn at ``position`` reached the training loop (for ``state_dict``)."""
        self._handed_out = max(self._handed_out, int(position) + 1)

    def __iter__(self) -> Iterator[List[int]]:
        # A DPDataLoader sets a sink right before building its iterator; the positions and sizes of
        # the batches go there and are handed out when the loader yields them. Without a sink, the
        # batch is handed out when this iterator yields it.
        return self._iterate(self._sink)

    def _iterate(self, sink: Optional[Deque[Tuple[int, int]]]) -> Iterator[List[int]]:
        for position, batch in self.draws():
            if sink is None:
                self.hand_out(position)
            else:
                sink.append((position, len(batch)))
            if self.listener is not None:
                self.listener(len(batch))
            yield batch

    def state_dict(self) -> Dict[str, Any]:
        """Plain ints/floats, loadable with ``torch.load(weights_only=True)``."""
        return {
            "num_samples": self.num_samples,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "rank": self.rank,
            "world_size": self.world_size,
            "secure": self.secure,
            "seed": -1 if self.seed is None else self.seed,
            "position": self._handed_out,
            "epoch": self._handed_out // self.steps,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume: the next draw is the first one the saved run had not handed out."""
        if "position" not in state:
            raise ValueError(
                "this sampler state was saved by an older dptorch (it has no 'position'); resume with the version "
                "that saved it, or start the sampling anew"
            )
        # Not the rank: every rank's draw is a function of (seed, position) (its own slice of it), so any
        # rank's state of the run describes this rank's too (a checkpoint written by rank 0 resumes all).
        for key in ("num_samples", "sample_rate", "steps", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state has {key}={state[key]}, this sampler has {getattr(self, key)}")
        if bool(state.get("secure", False)) != self.secure:
            raise ValueError(
                f"state was saved by a sampler with secure={bool(state.get('secure', False))}, this one has "
                f"secure={self.secure}; build the loader with the same secure_mode as the run that saved it"
            )
        seed = int(state["seed"])
        self.seed = None if seed < 0 else seed
        self._position = self._handed_out = int(state["position"])


# ---------------------------------------------------------------------------------------------
# Empty batches


def empty_batch_like(batch: Any) -> Any:
    """A copy of collated ``batch`` with batch size 0: same nesting, dtypes and trailing shapes.

    Tensors and arrays become empty along dim 0 (0-dim ones are copied); mappings, named
    tuples, and tuples or lists holding tensors are rebuilt with the same type; a list or tuple
    whose items are all plain values (strings, numbers: a per-sample column, as
    ``default_collate`` makes for strings) becomes empty; any other leaf is returned unchanged.
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch.clone()
        return batch.new_empty((0, *batch.shape[1:]))
    if isinstance(batch, np.ndarray):
        if batch.ndim == 0:
            return batch.copy()
        return np.empty((0, *batch.shape[1:]), dtype=batch.dtype)
    if isinstance(batch, Mapping):
        items = {key: empty_batch_like(value) for key, value in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple: fields kept
        return type(batch)(*(empty_batch_like(item) for item in batch))
    if isinstance(batch, (list, tuple)):
        if all(_is_plain_value(item) for item in batch):
            return type(batch)()
        items = [empty_batch_like(item) for item in batch]
        try:
            return type(batch)(items)
        except TypeError:
            return items
    return batch


def _is_plain_value(item: Any) -> bool:
    return isinstance(item, (str, bytes, int, float, bool, complex)) or item is None


class EmptyBatchCollate:
    """Collate function returning ``empty_batch_like(template)`` for an empty index list.

    ``template`` is the collated batch of one real sample; a fresh empty batch is built on
    every call, so a training loop that mutates the batch (e.g. ``inputs.pop("labels")``)
    does not affect later ones. The wrapped function is ``self.collate_fn``.
    """

    def __init__(self, collate_fn: Callable[[List[Any]], Any], template: Any):
        self.collate_fn = collate_fn
        self.template = empty_batch_like(template)

    @classmethod
    def for_dataset(cls, dataset: Dataset, collate_fn: Optional[Callable] = None) -> "EmptyBatchCollate":
        """Wrap ``collate_fn`` (default: ``default_collate``), templating from ``dataset[0]``."""
        if isinstance(collate_fn, EmptyBatchCollate):
            collate_fn = collate_fn.collate_fn
        collate_fn = default_collate if collate_fn is None else collate_fn
        if len(dataset) == 0:
            raise ValueError("cannot Poisson-sample from an empty dataset")
        return cls(collate_fn, collate_fn([dataset[0]]))

    def __call__(self, samples: List[Any]) -> Any:
        if len(samples) == 0:
            return empty_batch_like(self.template)
        return self.collate_fn(samples)


# ---------------------------------------------------------------------------------------------
# Loader


def check_map_style(dataset: Any) -> None:
    """Raise the ValueError explaining why Poisson sampling needs a map-style dataset."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise ValueError(_ITERABLE_DATASET_ERROR)


def check_sampler_replaceable(data_loader: DataLoader) -> None:
    """Refuse a loader whose element sampler Poisson sampling would silently drop.

    The DP loader draws every sample of ``data_loader.dataset`` independently with the same
    probability q: that uniform draw is what the privacy analysis assumes. It may replace torch's
    default samplers (``SequentialSampler``, ``RandomSampler`` over the whole dataset without
    replacement) and a ``DistributedSampler`` (the DP loader shards the draw itself). Any other
    sampler chose *which* samples to draw or how often (``WeightedRandomSampler``'s weights,
    ``SubsetRandomSampler``'s subset, a custom order): dropping it without a word would train on
    rows the user excluded or ignore the weights, so it is refused with the fix.
    """
    from torch.utils.data import RandomSampler, SequentialSampler
    from torch.utils.data.distributed import DistributedSampler

    samplers = [data_loader.sampler]
    inner = getattr(data_loader.batch_sampler, "sampler", None)
    if inner is not None and inner is not data_loader.sampler:
        samplers.append(inner)
    for sampler in samplers:
        if isinstance(sampler, (SequentialSampler, DistributedSampler)):
            continue
        if isinstance(sampler, RandomSampler):
            size = len(data_loader.dataset)
            if not sampler.replacement and sampler.num_samples == size:
                continue
            what = (f"RandomSampler(replacement={sampler.replacement}, num_samples={sampler.num_samples}) over "
                    f"{size} samples")
        else:
            what = type(sampler).__name__
        raise ValueError(
            f"the data loader draws its samples with {what}, but DP-SGD replaces the sampler by Poisson sampling: "
            "every sample of data_loader.dataset is drawn independently with the same probability, as the privacy "
            "analysis requires. Your sampler's choice (which rows, their weights, their number per epoch) would be "
            "dropped without a word: a SubsetRandomSampler's excluded rows would be trained on, a "
            "WeightedRandomSampler's weights ignored. To train on a subset, pass torch.utils.data.Subset(dataset, "
            "indices) as the dataset (N is then the subset's size); to weigh samples, weigh their losses (each "
            "sample's gradient is still clipped); otherwise build the DataLoader with batch_size and shuffle only"
        )


def worker_settings(data_loader: DataLoader) -> Dict[str, Any]:
    """The worker/pinning settings of ``data_loader`` as DataLoader keyword arguments."""
    settings = {name: getattr(data_loader, name) for name in _WORKER_SETTINGS if hasattr(data_loader, name)}
    if data_loader.num_workers > 0:
        settings["prefetch_factor"] = data_loader.prefetch_factor
    else:
        settings["persistent_workers"] = False
    return settings


def check_sharded_for_process_group(batch_sampler: Any) -> None:
    """Refuse a Poisson sampler that is not sharded for the initialised process group (world size > 1).

    Under torch.distributed the DP optimizer adds up the clipped sums of all ranks and adds the noise
    once, and the plan accounts one Poisson draw of rate q over the whole dataset: each rank must
    draw its own shard (``rank::world_size``) of that one draw. A sampler built without
    ``distributed=True`` draws a Poisson sample of the whole dataset on every rank (ranks with one
    seed draw the very same rows), so one row can enter a step once per rank: its contribution to the
    summed update is up to ``world_size * C`` while noise, divisor and accountant assume C. Every
    loader kind is held to this (``DPDataLoader``, ``CyclicPoissonDataLoader``).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size == 1 or getattr(batch_sampler, "mirror", None) is not None:  # TP: one data-parallel rank
        return
    if not getattr(batch_sampler, "shardable", True):
        raise ValueError(
            f"{type(batch_sampler).__name__} draws its batches on one process only, but training runs on rank {rank} "
            f"of {world_size} processes: every rank would draw its own batch and the clipped sums of all ranks are "
            "added up (one sample could count once per rank). Use a DPDataLoader(..., distributed=True) (Poisson "
            "sampling) under torch.distributed"
        )
    has, at = int(getattr(batch_sampler, "world_size", 1)), int(getattr(batch_sampler, "rank", 0))
    if (has, at) == (world_size, rank):
        return
    kind = "CyclicPoissonDataLoader" if hasattr(batch_sampler, "bands") else "DPDataLoader"
    built = "without distributed=True" if has == 1 else f"for rank {at} of {has} processes"
    raise ValueError(
        f"this {kind} was built {built}, but training runs on rank {rank} of {world_size} processes: every rank "
        f"would draw its own Poisson sample of the whole dataset (with one seed, the very same rows), and the "
        f"clipped sums of all ranks are added up, so one sample could count {world_size} times in one step "
        f"(sensitivity {world_size} C) while the noise, the divisor and the accountant assume one draw of the "
        f"whole dataset at rate q. Build it after init_process_group with {kind}(..., distributed=True) (each "
        "rank draws its shard rank::world_size of one global Poisson batch), or pass a plain DataLoader to "
        "make_private, which rebuilds it sharded"
    )


def mirror_draws(batch_sampler: Any, group: Any, data_parallel: Any = None) -> None:
    """Make every draw of ``batch_sampler`` rank 0's of ``group`` (tensor parallelism: the ranks of the
    group train on one batch). The sampler must be sharded over the ``data_parallel`` group (None: not
    sharded), each of whose ranks holds other samples."""
    import torch.distributed as dist

    expected = (dist.get_rank(data_parallel), dist.get_world_size(data_parallel)) if data_parallel is not None else (0, 1)
    has = (int(getattr(batch_sampler, "rank", 0)), int(getattr(batch_sampler, "world_size", 1)))
    if has != expected:
        how = ("DPDataLoader(..., distributed=mesh['dp'].get_group())" if data_parallel is not None
               else "a DPDataLoader without distributed=True")
        raise ValueError(
            f"this loader's Poisson sampler is rank {has[0]} of {has[1]} shards, but under tensor parallelism every "
            f"rank of a tensor-parallel group trains on the same batch, so the draws are sharded over the "
            f"data-parallel ranks only (rank {expected[0]} of {expected[1]} here): build {how}, or pass a plain "
            "DataLoader to make_private, which builds it"
        )
    if not hasattr(batch_sampler, "mirror") or not getattr(batch_sampler, "shardable", True):
        raise ValueError(f"{type(batch_sampler).__name__} cannot share its draws over a tensor-parallel group; "
                         "use a DPDataLoader (Poisson sampling) under tensor parallelism")
    batch_sampler.mirror = group


def distributed_rank_and_world_size(group: Any = None) -> tuple:
    """(rank, world_size) in ``group`` (default: the initialised default process group); ValueError if none."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("distributed=True needs torch.distributed to be initialised first")
    return dist.get_rank(group), dist.get_world_size(group)


class DPDataLoader(DataLoader):
    """A DataLoader whose batches are Poisson samples of rate ``sample_rate``.

    Yields exactly ``len(self)`` batches per epoch (``steps``, default ``round(1/q)``), some
    possibly empty; empty batches have the structure of normal ones with leading dim 0 (see
    ``EmptyBatchCollate``). ``generator`` and ``seed`` drive the sampler only (worker seeds
    come from torch's global RNG, so iterating the loader does not disturb the sampling
    stream). ``secure_mode=True`` draws the batches from the OS CSPRNG (``secure=True`` of the
    sampler; no seed, no generator). With ``distributed=True`` each rank samples its shard
    ``rank::world_size`` with the same q; the global batch has expected size ``q * len(dataset)``.
    ``set_epoch``, ``state_dict`` and ``load_state_dict`` delegate to the batch sampler.

    Every batch the loader yields is a new draw (new iterators, partial epochs and several live
    iterators included; see ``PoissonBatchSampler``). When the loader yields a batch it marks the
    draw as handed out (what ``state_dict`` resumes from) and, once ``PrivacyEngine.make_private``
    has attached its plan (``privacy_plan``), reports the draw and its size to the plan, which
    checks at ``optimizer.step()`` that one draw fed the step and that the backward passes saw
    exactly its samples.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        sample_rate: float,
        collate_fn: Optional[Callable] = None,
        generator: Optional[torch.Generator] = None,
        steps: Optional[int] = None,
        seed: Optional[int] = None,
        distributed: Any = False,
        secure_mode: bool = False,
        **dataloader_kwargs: Any,
    ):
        check_map_style(dataset)
        conflicting = {"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(dataloader_kwargs)
        if conflicting:
            raise TypeError(f"{type(self).__name__} chooses its own batches; remove {sorted(conflicting)}")
        rank, world_size = distributed_rank_and_world_size(None if distributed is True else distributed) if distributed else (0, 1)
        batch_sampler = self._batch_sampler(
            len(dataset), sample_rate, steps=steps, generator=generator, seed=seed, rank=rank,
            world_size=world_size, secure=secure_mode,
        )
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=self._collate(dataset, collate_fn),
            **dataloader_kwargs,
        )
        self.sample_rate = batch_sampler.sample_rate
        self.world_size = world_size
        self.rank = rank
        self.distributed = distributed
        self.secure_mode = bool(secure_mode)
        #: The privacy plan told of every batch handed out (set by ``PrivacyEngine.make_private``).
        self.privacy_plan: Optional[Any] = None

    def _batch_sampler(self, num_samples: int, sample_rate: float, **options: Any) -> "PoissonBatchSampler":
        """The sampler that draws this loader's batches (a subclass may draw otherwise)."""
        return PoissonBatchSampler(num_samples, sample_rate, **options)

    def _collate(self, dataset: Dataset, collate_fn: Optional[Callable]) -> Callable[[List[Any]], Any]:
        """The collate function of this loader's batches (a subclass may pad them)."""
        return EmptyBatchCollate.for_dataset(dataset, collate_fn)

    @property
    def steps(self) -> int:
        """Draws per epoch (``len(self)``)."""
        return self.batch_sampler.steps

    def __iter__(self) -> "_HandingOutIterator":
        sizes: Deque[Tuple[int, int]] = deque()
        self.batch_sampler._sink = sizes
        try:
            inner = super().__iter__()  # the batch sampler's iterators are created in here
        finally:
            self.batch_sampler._sink = None
        # Out-of-order workers may yield batches in another order than the sampler drew them.
        ordered = self.num_workers == 0 or getattr(self, "in_order", True)
        return _HandingOutIterator(self, inner, sizes, ordered)

    def hand_out(self, position: Optional[int], size: Optional[int]) -> None:
        """A batch (draw ``position``, ``size`` samples on this rank) reaches the training loop."""
        if self.privacy_plan is not None:  # a process group started after make_private is held to the same rule
            check_sharded_for_process_group(self.batch_sampler)
        if position is not None:
            self.batch_sampler.hand_out(position)
        if self.privacy_plan is not None:
            self.privacy_plan.on_draw(size)

    @classmethod
    def from_data_loader(
        cls,
        data_loader: DataLoader,
        *,
        generator: Optional[torch.Generator] = None,
        distributed: Any = False,
        seed: Optional[int] = None,
        secure_mode: bool = False,
    ) -> "DPDataLoader":
        """A Poisson loader with q = 1/len(data_loader), keeping dataset, collate and workers.

        The expected (global) batch size is len(dataset)/len(data_loader), i.e. the original
        batch size (slightly less when the last batch is partial).

        A loader with ``batch_size=None`` and a ``batch_sampler`` (Accelerate's prepared loaders,
        a loader built on Opacus' ``UniformWithReplacementSampler``) takes its rate from the batch
        sampler: a Poisson batch sampler (``PoissonBatchSampler``, also found inside Accelerate's
        ``BatchSamplerShard``) keeps its sample rate and steps per epoch; a fixed-size batch
        sampler (one with an integer ``batch_size``, as torch's ``BatchSampler``) gives q =
        1/len(data_loader), as a ``batch_size`` loader does. A batch sampler of variable-size
        batches (length grouping, token budgets) has no rate that describes it and is refused.
        """
        check_map_style(data_loader.dataset)
        if data_loader.batch_size is None:
            poisson = poisson_sampler_of(data_loader)
            if poisson is not None:
                if poisson.world_size > 1 and not distributed:
                    raise ValueError(
                        f"the source loader's Poisson batch sampler is rank {poisson.rank} of {poisson.world_size}; "
                        "pass distributed=True (with torch.distributed initialised) to keep sharding the batches"
                    )
                secure_mode = secure_mode or poisson.secure
                if secure_mode:
                    generator = seed = None
                return cls(
                    data_loader.dataset,
                    sample_rate=poisson.sample_rate,
                    steps=poisson.steps,
                    collate_fn=data_loader.collate_fn,
                    generator=generator,
                    seed=seed,
                    distributed=distributed,
                    secure_mode=secure_mode,
                    **worker_settings(data_loader),
                )
        try:
            num_batches = len(data_loader)
        except TypeError as error:
            raise ValueError(
                "the source DataLoader has no length (its sampler has no __len__), so the "
                "sample rate 1/len(data_loader) is unknown; build DPDataLoader(dataset, "
                "sample_rate=...) directly"
            ) from error
        check_sampler_replaceable(data_loader)
        if num_batches == 0:
            raise ValueError("the source DataLoader yields no batches")
        return cls(
            data_loader.dataset,
            sample_rate=1.0 / num_batches,
            collate_fn=data_loader.collate_fn,
            generator=generator,
            seed=seed,
            distributed=distributed,
            secure_mode=secure_mode,
            **worker_settings(data_loader),
        )

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def state_dict(self) -> Dict[str, Any]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)


def poisson_sampler_of(data_loader: DataLoader) -> Optional[PoissonBatchSampler]:
    """For a loader with ``batch_size=None``: its Poisson batch sampler, or None when its batches
    have a fixed size (q = 1/len then); ValueError when neither gives a sound rate.

    Follows ``.batch_sampler`` through wrappers (Accelerate's ``BatchSamplerShard``,
    ``SkipBatchSampler``) to the batch sampler that decides the batches.
    """
    batch_sampler = data_loader.batch_sampler
    if batch_sampler is None:
        raise ValueError(
            "the source DataLoader has batch_size=None and no batch_sampler (it yields unbatched "
            "samples), so it has no batch size to derive a sample rate from; build DPDataLoader(dataset, "
            "sample_rate=...) directly with the sample rate you want"
        )
    chain, current = [], batch_sampler
    while current is not None and len(chain) < 8:
        chain.append(current)
        if isinstance(current, PoissonBatchSampler):
            return current
        current = getattr(current, "batch_sampler", None)
    if any(_is_count(getattr(item, "batch_size", None)) for item in chain):
        return None
    raise ValueError(
        f"the source DataLoader draws its batches from a {type(batch_sampler).__name__}, which is neither a "
        "Poisson batch sampler (dptorch.data.PoissonBatchSampler, Opacus' UniformWithReplacementSampler) nor "
        "a sampler of fixed-size batches (an integer batch_size attribute): its batches vary in size by a rule "
        "(length grouping, token budgets) that no sample rate describes. Build DPDataLoader(dataset, "
        "sample_rate=...) directly with the sample rate you want"
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class _HandingOutIterator:
    """The loader's iterator: yields the collated batches, reporting each one as handed out."""

    def __init__(self, loader: DPDataLoader, inner: Iterator[Any], sizes: Deque[Tuple[int, int]], ordered: bool):
        self._loader = loader
        self._inner = inner
        self._sizes = sizes
        self._ordered = ordered
        self._handed: Optional[int] = None  # the number of the batch this iterator handed out last

    def __del__(self) -> None:
        if self._handed is not None and not sys.is_finalizing():  # the loop let go of it (a break, a fixed count)
            drawn.let_go(self._handed)

    def __iter__(self) -> "_HandingOutIterator":
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __next__(self) -> Any:
        try:
            batch = next(self._inner)
        except StopIteration:
            drawn.hand_out(())  # the pass is over: no batch of it is the loop's any more
            self._handed = None
            raise
        position, size = self._sizes.popleft() if self._sizes else (None, None)
        if not self._ordered:
            size = None  # the sizes queue is in draw order, the batches may not be
        self._loader.hand_out(position, size)
        self._handed = drawn.hand_out(batch)
        return batch


__all__ = [
    "DPDataLoader",
    "EmptyBatchCollate",
    "PoissonBatchSampler",
    "check_sharded_for_process_group",
    "mirror_draws",
    "default_steps",
    "draw_seed",
    "empty_batch_like",
    "epoch_seed",
]
