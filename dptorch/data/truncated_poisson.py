"""Truncated Poisson sampling padded to a fixed batch shape, for compiled steps (static batch dim).

A Poisson batch changes size every step, so a compiled step recompiles per size (static batch dim)
or gives up CUDA graphs (dynamic). Here every batch has exactly ``max_batch_size`` (B) rows:

1. each of the N samples is drawn independently with probability q (the Poisson draw);
2. when more than B are drawn, a uniformly random subset of exactly B of them is kept (the others
   are dropped for this step);
3. the k <= B kept samples are collated, and B - k padding rows, copies of dataset row 0 collated
   by the same function, are appended after them.

Steps 1-2 are what dp_accounting's ``TruncatedSubsampledGaussianDpEvent`` assumes (arXiv:2508.15089,
add-or-remove-one adjacency), which the 'pld' accountant composes (:mod:`dptorch.accounting.selection`).

The padding rows are no samples: the loader tells the privacy plan how many of a batch's rows are
real (the first k), the optimizer gives the rest of every backward round clip factor 0 and zeroes
their rows (the path of a non-finite unit), so they contribute exactly 0 to the clipped sum in
every grad sample mode, are not counted (clipping statistics, adaptive clipping's count), and the
``loss_reduction="mean"`` divisor stays the constant ``q N``. The real rows and the padding rows are
collated apart and joined along dim 0 (:func:`join_rows`), so whatever the collate function does
within a batch, the padding rows are the last ones. Each backward pass must run the model on the
whole latest batch, its rows in order (the controller's draw watch says so; anything else is refused:
``DrawLedger.padding_mask``). The loader hands out a batch only once ``make_private`` attached its
plan: without the plan's ledger nothing would drop the padding rows, and row 0 would be trained on at
every step. Out-of-order workers (``in_order=False``) are refused, since they lose which batch holds
how many real rows; so is ``BatchMemoryManager`` (choose ``max_batch_size`` to fit memory instead)
and torch.distributed (one process).

Randomness is the Poisson sampler's: draw ``k`` a function of ``(seed, k)``, the truncation's subset
taken from the same per-draw generator; ``secure_mode=True`` takes the inclusion bits and the
subset from the secure stream (``secure_bernoulli``, ``secure_subset``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from dptorch.accounting.selection import Selection
from dptorch.data.poisson import (
    DPDataLoader,
    EmptyBatchCollate,
    PoissonBatchSampler,
    check_map_style,
    check_sharded_for_process_group,
    worker_settings,
)
from dptorch.noise import secure_subset


class TruncatedPoissonBatchSampler(PoissonBatchSampler):
    """Poisson draws of rate ``sample_rate`` truncated to at most ``max_batch_size`` indices (a uniformly
    random subset of the drawn ones when more are drawn). Everything else is ``PoissonBatchSampler``'s;
    it draws on one process (no shards)."""

    sampling = "truncated_poisson"
    shardable = False

    def __init__(self, num_samples: int, sample_rate: float, *, max_batch_size: int, steps: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None, secure: bool = False):
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or not 1 <= max_batch_size <= num_samples:
            raise ValueError(f"max_batch_size must be a whole number in [1, {num_samples}] (the dataset's size), "
                             f"got {max_batch_size!r}")
        super().__init__(num_samples, sample_rate, steps=steps, generator=generator, seed=seed, secure=secure)
        self.max_batch_size = max_batch_size

    @property
    def selection(self) -> Selection:
        return Selection("truncated_poisson", self.num_samples, self.max_batch_size)

    def draw(self) -> Tuple[int, List[int]]:
        position, indices = super().draw()
        if len(indices) > self.max_batch_size:  # the same per-draw generator (seeded) or the secure stream
            if self.secure:
                kept = secure_subset(len(indices), self.max_batch_size).tolist()
            else:
                kept = torch.randperm(len(indices), generator=self.generator)[: self.max_batch_size].tolist()
            indices = sorted(indices[i] for i in kept)
        return position, indices

    def state_dict(self):
        return {**super().state_dict(), "max_batch_size": self.max_batch_size}

    def load_state_dict(self, state) -> None:
        if state.get("max_batch_size") != self.max_batch_size:
            raise ValueError(f"state has max_batch_size={state.get('max_batch_size')}, this sampler has "
                             f"{self.max_batch_size}")
        super().load_state_dict(state)


class PaddedCollate:
    """Collate ``k <= rows`` samples into a batch of exactly ``rows`` rows: the samples collated by
    ``collate_fn``, then ``rows - k`` copies of ``padding_sample`` collated by it, joined along dim 0."""

    def __init__(self, collate_fn: Callable[[List[Any]], Any], padding_sample: Any, rows: int):
        self.collate_fn = collate_fn
        self.padding_sample = padding_sample
        self.rows = int(rows)

    @classmethod
    def for_dataset(cls, dataset: Dataset, collate_fn: Optional[Callable], rows: int) -> "PaddedCollate":
        """Pad with copies of ``dataset[0]`` (default collate: ``default_collate``)."""
        if isinstance(collate_fn, EmptyBatchCollate):
            collate_fn = collate_fn.collate_fn
        if len(dataset) == 0:
            raise ValueError("cannot sample from an empty dataset")
        return cls(default_collate if collate_fn is None else collate_fn, dataset[0], rows)

    def __call__(self, samples: List[Any]) -> Any:
        missing = self.rows - len(samples)
        if missing < 0:
            raise ValueError(f"{len(samples)} samples for a padded batch of {self.rows} rows")
        if missing == 0:
            return self.collate_fn(samples)
        padding = self.collate_fn([self.padding_sample] * missing)
        return join_rows(self.collate_fn(samples), padding) if samples else padding


def join_rows(first: Any, second: Any) -> Any:
    """Two collated batches as one, ``first``'s rows then ``second``'s: tensors joined along dim 0 (equal
    shapes beyond it), mappings and tuples/lists of batches item by item, lists of per-row values
    (strings, numbers) one after the other. A structure that cannot be joined is refused."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        if first.dim() == 0 or first.shape[1:] != second.shape[1:] or first.dtype != second.dtype:
            raise ValueError(
                f"cannot join the real rows {tuple(first.shape)} ({first.dtype}) and the padding rows "
                f"{tuple(second.shape)} ({second.dtype}) of a fixed-shape batch along dim 0: the collate function "
                "must give every batch the same shape beyond dim 0 (pad sequences to a fixed length)"
            )
        return torch.cat([first, second])
    if isinstance(first, Mapping) and isinstance(second, Mapping) and first.keys() == second.keys():
        joined = {key: join_rows(first[key], second[key]) for key in first}
        return joined if type(first) is dict else type(first)(joined)
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)) and type(first) is type(second):
        if all(isinstance(v, (str, bytes, int, float, bool)) for v in (*first, *second)):
            return first + second  # per-row values
        if len(first) == len(second):
            items = [join_rows(a, b) for a, b in zip(first, second)]
            return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    raise ValueError(
        f"cannot join a batch of {type(first).__name__} and one of {type(second).__name__} along the rows: a padded "
        "batch's collate function must return tensors (or mappings, tuples and lists of them)"
    )


class TruncatedPoissonDataLoader(DPDataLoader):
    """A loader of truncated Poisson batches padded to exactly ``max_batch_size`` rows (module docstring).

    ``sample_rate`` is the Poisson rate q; ``len()`` is ``steps`` (default ``round(1 / q)``). Pass it to
    ``make_private`` (with the 'pld' accountant), then iterate the loader it returns.
    """

    pads_batches = True

    def __init__(self, dataset: Dataset, *, sample_rate: float, max_batch_size: int,
                 collate_fn: Optional[Callable] = None, generator: Optional[torch.Generator] = None,
                 steps: Optional[int] = None, seed: Optional[int] = None, secure_mode: bool = False,
                 **dataloader_kwargs: Any):
        if dataloader_kwargs.get("num_workers", 0) and dataloader_kwargs.get("in_order") is False:
            raise ValueError("a padded loader needs its workers in order (in_order=True): it tells the privacy plan "
                             "how many rows of each batch are real, in the order the sampler drew them")
        if "distributed" in dataloader_kwargs:
            raise TypeError("TruncatedPoissonDataLoader draws on one process (no distributed=): use a "
                            "DPDataLoader(..., distributed=True) under torch.distributed")
        self._max_batch_size = max_batch_size
        super().__init__(dataset, sample_rate=sample_rate, collate_fn=collate_fn, generator=generator, steps=steps,
                         seed=seed, secure_mode=secure_mode, **dataloader_kwargs)

    def _batch_sampler(self, num_samples: int, sample_rate: float, **options: Any) -> TruncatedPoissonBatchSampler:
        options.pop("rank", None), options.pop("world_size", None)  # one process
        return TruncatedPoissonBatchSampler(num_samples, sample_rate, max_batch_size=self._max_batch_size, **options)

    def _collate(self, dataset: Dataset, collate_fn: Optional[Callable]) -> PaddedCollate:
        return PaddedCollate.for_dataset(dataset, collate_fn, self._max_batch_size)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sampler.max_batch_size

    def hand_out(self, position: Optional[int], size: Optional[int]) -> None:
        """A batch (draw ``position``, ``size`` real rows then padding) reaches the training loop."""
        plan = self.privacy_plan
        if plan is None or plan.draws is None:
            raise RuntimeError(
                "a TruncatedPoissonDataLoader hands out its padded batches only once make_private attached its privacy "
                "plan: the plan's ledger tells the optimizer which rows are padding, and without it the padding rows "
                "(copies of dataset row 0) would be trained on at every step. Pass this loader to make_private and "
                "iterate the loader it returns"
            )
        if size is None:
            raise RuntimeError("the real rows of this padded batch are unknown (workers yielding out of order); "
                               "build the loader with in_order=True")
        check_sharded_for_process_group(self.batch_sampler)
        if position is not None:
            self.batch_sampler.hand_out(position)
        plan.on_draw(size, padded=self.max_batch_size)

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, max_batch_size: int,
                         generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                         secure_mode: bool = False) -> "TruncatedPoissonDataLoader":
        """Truncated Poisson batches of the loader's expected size: q = 1 / len(data_loader)."""
        check_map_style(data_loader.dataset)
        if len(data_loader) == 0:
            raise ValueError("the source DataLoader yields no batches")
        return cls(data_loader.dataset, sample_rate=1.0 / len(data_loader), max_batch_size=max_batch_size,
                   collate_fn=data_loader.collate_fn, generator=generator, seed=seed, secure_mode=secure_mode,
                   **worker_settings(data_loader))


__all__ = ["PaddedCollate", "TruncatedPoissonBatchSampler", "TruncatedPoissonDataLoader", "join_rows"]
