"""Poisson subsampling for DP-SGD.

The privacy analysis of DP-SGD (the subsampled Gaussian mechanism) assumes that every batch
includes each sample independently with probability ``q``. Batch sizes are therefore random
(Binomial(N, q)) and may be zero. This module provides a batch sampler with that law and a
``DataLoader`` built on it whose empty batches keep the structure of normal ones.

Sampling randomness should stay secret from whoever sees the trained model; seeding it (for
reproducibility or resumption) is fine as long as the seed is not published.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

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


def epoch_seed(seed: int, epoch: int) -> int:
    """A 64-bit seed for ``epoch`` derived from ``seed`` (SplitMix64 finaliser), deterministic."""
    z = (seed + (epoch + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def default_steps(sample_rate: float) -> int:
    """Number of batches in one epoch: round(1/q), at least 1."""
    return max(1, round(1.0 / sample_rate))


class PoissonBatchSampler:
    """Yields ``steps`` batches (lists of indices), each including every index with prob. ``q``.

    ``len()`` is ``steps`` (default ``round(1/q)``) and exactly that many batches are yielded,
    some possibly empty. There is deliberately no ``.sampler`` attribute (Accelerate would
    replace a ``RandomSampler`` found there).

    Randomness: with ``seed`` the generator is reseeded from ``(seed, epoch)`` at the start of
    every epoch, so any epoch can be replayed. With only ``generator`` the stream simply
    continues across epochs. With neither, a seed is drawn from torch's global RNG (so
    ``torch.manual_seed`` makes runs reproducible).

    Epochs: ``set_epoch(e)`` is idempotent (a no-op when ``e`` is the current epoch). A pass
    that yields all its batches advances the epoch by one, so forgetting ``set_epoch`` does not
    repeat batches; an interrupted pass is not counted and a new pass restarts that epoch (in
    seed mode, with the same batches).

    Distributed: rank ``r`` of ``world_size`` draws the full mask and keeps indices
    ``r::world_size``. With the same seed on all ranks the shards are disjoint pieces of one
    Poisson batch over the whole dataset; with different seeds each index is still included
    independently with probability ``q``. Either way the global batch is Poisson with rate q.

    Checkpointing: ``state_dict()`` holds the generator state at the start of the current
    epoch and the number of batches handed out since; after ``load_state_dict`` the next pass
    redraws and skips those batches, yielding the remaining ones of that epoch exactly as the
    original run would. Note that a ``DataLoader`` with workers pulls batches from the sampler
    ahead of the training loop (prefetching), so mid-epoch states overcount consumed batches;
    states saved at epoch boundaries (or with ``num_workers=0``) are exact.
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
        if seed is None and generator is None:
            seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps = default_steps(sample_rate) if steps is None else int(steps)
        self.seed = None if seed is None else int(seed) & _MASK64
        self.generator = generator if generator is not None else torch.Generator()
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.epoch = 0
        self._epoch_start_state: Optional[torch.Tensor] = None
        self._batches_yielded = 0
        self._pending_skip = 0

    def __len__(self) -> int:
        return self.steps

    @property
    def shard_size(self) -> int:
        """Number of indices this rank samples from."""
        return len(range(self.rank, self.num_samples, self.world_size))

    @property
    def expected_batch_size(self) -> float:
        """Expected number of indices per batch on this rank: q * shard_size."""
        return self.sample_rate * self.shard_size

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at the next pass; a no-op if it is already the current one."""
        if epoch == self.epoch:
            return
        self.epoch = int(epoch)
        self._epoch_start_state = None
        self._batches_yielded = 0
        self._pending_skip = 0

    def __iter__(self) -> Iterator[List[int]]:
        if self._pending_skip == 0 or self._epoch_start_state is None:
            if self.seed is not None:
                self.generator.manual_seed(epoch_seed(self.seed, self.epoch))
            self._epoch_start_state = self.generator.get_state()
        else:
            self.generator.set_state(self._epoch_start_state)
        skip, self._pending_skip = self._pending_skip, 0
        self._batches_yielded = skip
        for step in range(self.steps):
            batch = self._draw_batch()
            if step < skip:
                continue
            self._batches_yielded = step + 1
            yield batch
        self.epoch += 1
        self._epoch_start_state = None
        self._batches_yielded = 0

    def _draw_batch(self) -> List[int]:
        mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
        if self.world_size > 1:
            mask = mask[self.rank :: self.world_size]
        local = mask.nonzero().flatten()
        return (local * self.world_size + self.rank).tolist()

    def state_dict(self) -> Dict[str, Any]:
        """Plain ints/floats/tensors, loadable with ``torch.load(weights_only=True)``."""
        start_state = self._epoch_start_state
        if start_state is None:
            start_state = (
                torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch)).get_state()
                if self.seed is not None
                else self.generator.get_state()
            )
        return {
            "num_samples": self.num_samples,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "rank": self.rank,
            "world_size": self.world_size,
            "seed": -1 if self.seed is None else self.seed,
            "epoch": self.epoch,
            "generator_state": start_state.clone(),
            "batches_yielded": self._batches_yielded,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume: the next pass yields the batches of ``state``'s epoch not yet handed out."""
        for key in ("num_samples", "sample_rate", "steps", "rank", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state has {key}={state[key]}, this sampler has {getattr(self, key)}")
        seed = int(state["seed"])
        self.seed = None if seed < 0 else seed
        self.epoch = int(state["epoch"])
        self._epoch_start_state = state["generator_state"].clone()
        self.generator.set_state(self._epoch_start_state)
        self._batches_yielded = int(state["batches_yielded"])
        self._pending_skip = self._batches_yielded


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


def worker_settings(data_loader: DataLoader) -> Dict[str, Any]:
    """The worker/pinning settings of ``data_loader`` as DataLoader keyword arguments."""
    settings = {name: getattr(data_loader, name) for name in _WORKER_SETTINGS if hasattr(data_loader, name)}
    if data_loader.num_workers > 0:
        settings["prefetch_factor"] = data_loader.prefetch_factor
    else:
        settings["persistent_workers"] = False
    return settings


def distributed_rank_and_world_size() -> tuple:
    """(rank, world_size) of the initialised default process group; ValueError if none."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("distributed=True needs torch.distributed to be initialised first")
    return dist.get_rank(), dist.get_world_size()


class DPDataLoader(DataLoader):
    """A DataLoader whose batches are Poisson samples of rate ``sample_rate``.

    Yields exactly ``len(self)`` batches per epoch (``steps``, default ``round(1/q)``), some
    possibly empty; empty batches have the structure of normal ones with leading dim 0 (see
    ``EmptyBatchCollate``). ``generator`` and ``seed`` drive the sampler only (worker seeds
    come from torch's global RNG, so iterating the loader does not disturb the sampling
    stream). With ``distributed=True`` each rank samples its shard ``rank::world_size`` with the
    same q; the global batch has expected size ``q * len(dataset)``. ``set_epoch``,
    ``state_dict`` and ``load_state_dict`` delegate to the batch sampler.
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
        distributed: bool = False,
        **dataloader_kwargs: Any,
    ):
        check_map_style(dataset)
        conflicting = {"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(dataloader_kwargs)
        if conflicting:
            raise TypeError(f"DPDataLoader chooses its own batches; remove {sorted(conflicting)}")
        rank, world_size = distributed_rank_and_world_size() if distributed else (0, 1)
        batch_sampler = PoissonBatchSampler(
            len(dataset),
            sample_rate,
            steps=steps,
            generator=generator,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=EmptyBatchCollate.for_dataset(dataset, collate_fn),
            **dataloader_kwargs,
        )
        self.sample_rate = batch_sampler.sample_rate
        self.world_size = world_size
        self.rank = rank
        self.distributed = distributed

    @classmethod
    def from_data_loader(
        cls,
        data_loader: DataLoader,
        *,
        generator: Optional[torch.Generator] = None,
        distributed: bool = False,
        seed: Optional[int] = None,
    ) -> "DPDataLoader":
        """A Poisson loader with q = 1/len(data_loader), keeping dataset, collate and workers.

        The expected (global) batch size is len(dataset)/len(data_loader), i.e. the original
        batch size (slightly less when the last batch is partial).
        """
        check_map_style(data_loader.dataset)
        if data_loader.batch_size is None:
            raise ValueError(
                "the source DataLoader has batch_size=None (a custom batch_sampler, or unbatched "
                "samples), so its batch size is unknown; build DPDataLoader(dataset, "
                "sample_rate=...) directly with the sample rate you want"
            )
        try:
            num_batches = len(data_loader)
        except TypeError as error:
            raise ValueError(
                "the source DataLoader has no length (its sampler has no __len__), so the "
                "sample rate 1/len(data_loader) is unknown; build DPDataLoader(dataset, "
                "sample_rate=...) directly"
            ) from error
        if num_batches == 0:
            raise ValueError("the source DataLoader yields no batches")
        return cls(
            data_loader.dataset,
            sample_rate=1.0 / num_batches,
            collate_fn=data_loader.collate_fn,
            generator=generator,
            seed=seed,
            distributed=distributed,
            **worker_settings(data_loader),
        )

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def state_dict(self) -> Dict[str, Any]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)


__all__ = [
    "DPDataLoader",
    "EmptyBatchCollate",
    "PoissonBatchSampler",
    "default_steps",
    "empty_batch_like",
    "epoch_seed",
]
