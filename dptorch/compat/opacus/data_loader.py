"""``opacus.data_loader``: DPDataLoader (implementation: dptorch.data), Opacus' collate wrapper for empty
batches (``CollateFnWithEmpty``, ``wrap_collate_with_empty``) and ``switch_generator``.

dptorch's own loader needs no learned structure: it templates its empty batches on ``dataset[0]``
(``dptorch.data.EmptyBatchCollate``). ``CollateFnWithEmpty`` is Opacus' stateful variant for code that
builds its own loader: it learns the structure from the first non-empty batch.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils.data import BatchSampler, DataLoader

from dptorch.compat.opacus import DPDataLoader
from dptorch.data.poisson import PoissonBatchSampler

#: Opacus' logger name, renamed as the served path (``dptorch.data_loader``).
logger = logging.getLogger("dptorch.data_loader")

_RAND_ON_EMPTY = (
    "rand_on_empty=True would train on a made-up sample when the Poisson draw is empty; dptorch trains on "
    "the empty batch instead (the step still adds its noise and is accounted): leave rand_on_empty False"
)


def empty_along(sample: Any, batch_dim: int) -> Any:
    """``sample`` (tensors in dicts, lists, tuples) with size 0 along ``batch_dim``; other leaves are
    refused with ``TypeError`` (returning them would hand out data for a batch that has none)."""
    if torch.is_tensor(sample):
        shape = list(sample.shape)
        shape[batch_dim] = 0
        return sample.new_empty(shape)
    if isinstance(sample, Mapping):
        return {key: empty_along(value, batch_dim) for key, value in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)([empty_along(value, batch_dim) for value in sample])
    raise TypeError(f"Unsupported batch type: {type(sample).__name__}; an empty batch is built from tensors in "
                    "dicts, lists and tuples only: make the collate function return those")


class CollateFnWithEmpty:
    """``collator_fn`` for non-empty batches; for an empty one, the first non-empty batch's structure with
    size 0 along the batch dim (dim 0, or 1 with ``batch_first=False``). Before any non-empty batch, an
    empty batch is ``[zeros(shape, dtype) ...]`` from ``sample_empty_shapes`` and ``dtypes``, else ``[]``
    (both logged as warnings)."""

    def __init__(
        self,
        collator_fn: Optional[Callable[[List[Any]], Any]],
        batch_first: bool = True,
        rand_on_empty: bool = False,
        sample_empty_shapes: Optional[Sequence[Tuple[int, ...]]] = None,
        dtypes: Optional[Sequence[Any]] = None,
    ) -> None:
        if rand_on_empty:
            raise ValueError(_RAND_ON_EMPTY)
        self.wrapped_collator_fn = collator_fn
        self.batch_first = batch_first
        self.rand_on_empty = False
        self.sample_empty_shapes = sample_empty_shapes
        self.dtypes = dtypes
        self.first_batch: Any = None

    def __call__(self, batch: List[Any]) -> Any:
        if len(batch) > 0:
            output = self.wrapped_collator_fn(batch) if self.wrapped_collator_fn else batch
            if self.first_batch is None:  # the structure, without the data: built now, raised when needed
                try:
                    self.first_batch = empty_along(output, 0 if self.batch_first else 1)
                except TypeError as error:
                    self.first_batch = error
            return output
        if isinstance(self.first_batch, TypeError):
            raise TypeError(*self.first_batch.args)
        if self.first_batch is not None:
            return empty_along(self.first_batch, 0 if self.batch_first else 1)
        if self.sample_empty_shapes is not None and self.dtypes is not None:
            logger.warning("First batch is empty: returning zero-size tensors of the given sample_empty_shapes "
                           "and dtypes, which the model must accept")
            return [torch.zeros(shape, dtype=dtype) for shape, dtype in zip(self.sample_empty_shapes, self.dtypes)]
        logger.warning("First batch is empty: returning [] (no structure is known yet); pass sample_empty_shapes "
                       "and dtypes, or use dptorch.DPDataLoader, which templates empty batches on dataset[0]")
        return []


def wrap_collate_with_empty(
    *,
    collate_fn: Optional[Callable[[List[Any]], Any]],
    batch_first: bool = True,
    rand_on_empty: bool = False,
    sample_empty_shapes: Optional[Sequence[Tuple[int, ...]]] = None,
    dtypes: Optional[Sequence[Any]] = None,
) -> CollateFnWithEmpty:
    """``CollateFnWithEmpty`` around ``collate_fn`` (Opacus' keyword spelling)."""
    return CollateFnWithEmpty(collate_fn, batch_first=batch_first, rand_on_empty=rand_on_empty,
                              sample_empty_shapes=sample_empty_shapes, dtypes=dtypes)


def switch_generator(*, data_loader: DataLoader, generator: Optional[torch.Generator]) -> DataLoader:
    """A new loader like ``data_loader`` whose batches are drawn from ``generator``: a Poisson sampler (a
    DPDataLoader's) seeded from it with the same rate, steps and shard, or a ``BatchSampler`` whose inner
    sampler (``DataLoader(shuffle=True)``'s) uses it. A secure-mode DPDataLoader takes no generator (refused)."""
    options = dict(num_workers=data_loader.num_workers, pin_memory=data_loader.pin_memory, timeout=data_loader.timeout,
                   worker_init_fn=data_loader.worker_init_fn, persistent_workers=data_loader.persistent_workers,
                   multiprocessing_context=data_loader.multiprocessing_context)
    if data_loader.num_workers:
        options["prefetch_factor"] = data_loader.prefetch_factor
    batch_sampler = data_loader.batch_sampler
    if isinstance(data_loader, DPDataLoader):
        return type(data_loader)(data_loader.dataset, sample_rate=data_loader.sample_rate, steps=data_loader.steps,
                                 generator=generator, collate_fn=data_loader.collate_fn,
                                 distributed=data_loader.distributed, secure_mode=data_loader.secure_mode, **options)
    if isinstance(batch_sampler, PoissonBatchSampler):
        sampler: Any = PoissonBatchSampler(batch_sampler.num_samples, batch_sampler.sample_rate,
                                           steps=batch_sampler.steps, generator=generator, rank=batch_sampler.rank,
                                           world_size=batch_sampler.world_size)
    elif isinstance(batch_sampler, BatchSampler) and hasattr(batch_sampler.sampler, "generator"):
        inner = copy.copy(batch_sampler.sampler)
        inner.generator = generator
        sampler = BatchSampler(inner, batch_sampler.batch_size, batch_sampler.drop_last)
    else:
        raise ValueError("switch_generator needs a loader whose batch sampler is a Poisson sampler, or a BatchSampler "
                         "over a sampler with a generator (DataLoader(shuffle=True)); this one has nothing to switch")
    return DataLoader(data_loader.dataset, batch_sampler=sampler, collate_fn=data_loader.collate_fn,
                      generator=generator, **options)  # the loader's own draws (worker seeds) too, as shuffle=True's


__all__ = ["CollateFnWithEmpty", "DPDataLoader", "switch_generator", "wrap_collate_with_empty"]
