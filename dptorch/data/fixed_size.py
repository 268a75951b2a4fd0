"""Fixed-size batches: a uniformly random subset of exactly b samples at every step.

Every draw chooses b of the N samples uniformly at random without replacement, independently of
every other draw (a sample may be in consecutive batches, as with Poisson sampling). The batch
shape never changes, so a compiled step compiles once; no padding is needed.

Accounting (:mod:`dptorch.accounting.selection`): dp_accounting's ``SampledWithoutReplacementDpEvent``,
whose RDP (Wang, Balle and Kasiviswanathan 2019, Theorem 27) holds under replace-one adjacency:
N is public and neighbouring datasets differ in one sample's value. The clipped sum then moves by
up to 2C, so each step is composed as a Gaussian of noise multiplier ``sigma / 2`` with the 'rdp'
accountant (the only one with this event). That epsilon is not comparable with the
add-or-remove-one epsilon of Poisson sampling; at the same noise it is larger.

Randomness is the Poisson sampler's: draw ``k`` a function of ``(seed, k)`` (a ``randperm`` of its
per-draw generator); ``secure_mode=True`` takes each subset from the secure stream
(``secure_subset``). One process only (no shards).

Balls-in-bins sampling (each sample in one of the steps of an epoch, chosen at random) has no
accountant among the installed packages (dp_accounting 0.6 has no such event), so it is not offered.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from dptorch.accounting.selection import Selection
from dptorch.data.poisson import DPDataLoader, PoissonBatchSampler, check_map_style, draw_seed, worker_settings
from dptorch.noise import secure_subset


class FixedSizeBatchSampler(PoissonBatchSampler):
    """Draws of exactly ``batch_size`` distinct indices of ``range(num_samples)``, uniformly at random.

    ``sample_rate`` is ``batch_size / num_samples``; ``len()`` is ``steps`` (default
    ``round(num_samples / batch_size)``). Positions, epochs, hand-outs and checkpoints are
    ``PoissonBatchSampler``'s."""

    sampling = "fixed_size"
    shardable = False

    def __init__(self, num_samples: int, batch_size: int, *, steps: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None, secure: bool = False):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or not 1 <= batch_size <= num_samples:
            raise ValueError(f"batch_size must be a whole number in [1, {num_samples}] (the dataset's size), "
                             f"got {batch_size!r}")
        super().__init__(num_samples, batch_size / num_samples, steps=steps, generator=generator, seed=seed,
                         secure=secure)
        self.batch_size = batch_size

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    @property
    def selection(self) -> Selection:
        return Selection("fixed_size", self.num_samples, self.batch_size)

    def draw(self) -> Tuple[int, List[int]]:
        position = self._position
        self._position += 1
        if self.secure:
            chosen = secure_subset(self.num_samples, self.batch_size).tolist()
        else:
            self.generator.manual_seed(draw_seed(self.seed, position))
            chosen = torch.randperm(self.num_samples, generator=self.generator)[: self.batch_size].tolist()
        return position, sorted(chosen)

    def state_dict(self):
        return {**super().state_dict(), "batch_size": self.batch_size}

    def load_state_dict(self, state) -> None:
        if state.get("batch_size") != self.batch_size:
            raise ValueError(f"state has batch_size={state.get('batch_size')}, this sampler has {self.batch_size}")
        super().load_state_dict(state)


class FixedSizeDataLoader(DPDataLoader):
    """A loader whose every batch is a fresh uniformly random subset of exactly ``batch_size`` samples.

    Pass it to ``make_private`` with ``PrivacyEngine(accountant="rdp")`` (the module docstring says why),
    then iterate the loader it returns. ``from_data_loader(loader)`` keeps the loader's batch size.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, collate_fn: Optional[Any] = None,
                 generator: Optional[torch.Generator] = None, steps: Optional[int] = None, seed: Optional[int] = None,
                 secure_mode: bool = False, **dataloader_kwargs: Any):
        if "distributed" in dataloader_kwargs:
            raise TypeError("FixedSizeDataLoader draws on one process (no distributed=): use a "
                            "DPDataLoader(..., distributed=True) under torch.distributed")
        self._fixed_batch_size = batch_size
        check_map_style(dataset)
        if len(dataset) == 0:
            raise ValueError("cannot sample from an empty dataset")
        super().__init__(dataset, sample_rate=min(batch_size / len(dataset), 1.0), collate_fn=collate_fn, generator=generator, steps=steps,
                         seed=seed, secure_mode=secure_mode, **dataloader_kwargs)

    def _batch_sampler(self, num_samples: int, sample_rate: float, **options: Any) -> FixedSizeBatchSampler:
        options.pop("rank", None), options.pop("world_size", None)  # one process
        return FixedSizeBatchSampler(num_samples, self._fixed_batch_size, **options)

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, generator: Optional[torch.Generator] = None,
                         seed: Optional[int] = None, secure_mode: bool = False) -> "FixedSizeDataLoader":
        """Fixed-size batches of the loader's ``batch_size``."""
        if not isinstance(data_loader.batch_size, int):
            raise ValueError("the source DataLoader has no batch_size; build FixedSizeDataLoader(dataset, "
                             "batch_size=...) directly")
        return cls(data_loader.dataset, batch_size=data_loader.batch_size, collate_fn=data_loader.collate_fn,
                   generator=generator, seed=seed, secure_mode=secure_mode, **worker_settings(data_loader))


__all__ = ["FixedSizeBatchSampler", "FixedSizeDataLoader"]
