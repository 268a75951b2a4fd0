"""b-min-separated cyclic Poisson sampling, the sampling amplified banded MF needs.

The dataset is split once into ``b`` fixed partitions (a seeded random permutation cut into ``b``
near-equal parts, sizes differing by at most 1). Draw ``t`` Poisson-samples partition ``t mod b``:
each of its members is included independently with probability ``q_p`` (the partition sample
rate). A sample of partition k can only be in draws ``k, k + b, k + 2b, ...``: any two of its
participations are at least ``b`` draws apart (b-min-separation), and in n draws it takes part in
at most ``ceil(n / b)`` of them. ``b = 1`` is plain Poisson sampling at rate ``q_p`` (the same draws
as a :class:`~dptorch.data.poisson.PoissonBatchSampler` with the same seed).

Everything else is the Poisson sampler's: one position that never moves back, draw ``k`` a
function of ``(seed, k)``, ``state_dict`` keeping the position after the last batch handed to the
training loop (and the partition seed), secure mode, distributed shards (``index % world_size``).
Steps per epoch are a multiple of ``b`` (default ``b * round(1 / q_p)``: every sample is expected
once per epoch), so ``set_epoch`` keeps draw positions and partitions aligned.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from dptorch.data.poisson import (
    DPDataLoader,
    PoissonBatchSampler,
    check_map_style,
    default_steps,
    draw_seed,
    worker_settings,
)
from dptorch.noise import secure_bernoulli, secure_seed

_PARTITION_STREAM = 0x5DEECE66D  # separates the partition permutation from the draw seeds


def partitions(num_samples: int, bands: int, seed: int) -> List[torch.Tensor]:
    """The ``bands`` fixed partitions of ``range(num_samples)``, each sorted (b = 1: all, in order)."""
    if bands == 1:
        return [torch.arange(num_samples)]
    generator = torch.Generator().manual_seed(draw_seed(seed, _PARTITION_STREAM) & ((1 << 63) - 1))
    order = torch.randperm(num_samples, generator=generator)
    return [order[k::bands].sort().values for k in range(bands)]


class CyclicPoissonBatchSampler(PoissonBatchSampler):
    """Draw t Poisson-samples partition ``t mod bands`` at rate ``sample_rate`` (= q_p).

    ``sample_rate`` is the partition's rate: the expected batch is ``q_p * N / b``
    (``global_expected_batch_size``) and the accounting of amplified banded MF uses q_p.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        *,
        bands: int,
        steps: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        seed: Optional[int] = None,
        partition_seed: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        secure: bool = False,
    ):
        if not isinstance(bands, int) or isinstance(bands, bool) or bands < 1:
            raise ValueError(f"bands must be a whole number >= 1, got {bands!r}")
        if bands > num_samples:
            raise ValueError(f"cannot split {num_samples} samples into {bands} non-empty partitions")
        if steps is None:
            steps = bands * default_steps(sample_rate)
        elif steps % bands:
            raise ValueError(
                f"steps per epoch ({steps}) must be a multiple of bands ({bands}), so that every epoch starts at "
                "partition 0 and set_epoch keeps the b-min-separation"
            )
        super().__init__(num_samples, sample_rate, steps=steps, generator=generator, seed=seed, rank=rank,
                         world_size=world_size, secure=secure)
        self.bands = bands
        if partition_seed is None:
            partition_seed = secure_seed() if secure else self.seed
        self.partition_seed = int(partition_seed)
        self.partitions = partitions(self.num_samples, bands, self.partition_seed)

    def partition_of(self, position: int) -> int:
        return int(position) % self.bands

    @property
    def global_expected_batch_size(self) -> float:
        """Expected samples per draw over all ranks: q_p * N / b."""
        return self.sample_rate * self.num_samples / self.bands

    @property
    def expected_batch_size(self) -> float:
        return self.global_expected_batch_size / self.world_size

    def draw(self) -> Tuple[int, List[int]]:
        position = self._position
        self._position += 1
        members = self.partitions[position % self.bands]
        if self.secure:
            mask = torch.from_numpy(secure_bernoulli(members.numel(), self.sample_rate))
        else:
            self.generator.manual_seed(draw_seed(self.seed, position))
            mask = torch.rand(members.numel(), generator=self.generator) < self.sample_rate
        chosen = members[mask]
        if self.world_size > 1:
            chosen = chosen[chosen % self.world_size == self.rank]
        return position, chosen.tolist()

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "bands": self.bands, "partition_seed": self.partition_seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("bands") != self.bands:
            raise ValueError(f"state has bands={state.get('bands')}, this sampler has {self.bands}")
        super().load_state_dict(state)
        if int(state["partition_seed"]) != self.partition_seed:
            self.partition_seed = int(state["partition_seed"])
            self.partitions = partitions(self.num_samples, self.bands, self.partition_seed)


class CyclicPoissonDataLoader(DPDataLoader):
    """A :class:`DPDataLoader` whose batches come from a :class:`CyclicPoissonBatchSampler`.

    ``sample_rate`` is the partition rate q_p; ``from_data_loader(loader, bands=b)`` keeps the
    loader's expected batch size (q_p = b / len(loader)). When a privacy plan is attached, every
    batch handed out is checked against the plan's step index (its partition must be the step's).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        sample_rate: float,
        bands: int,
        collate_fn: Optional[Any] = None,
        generator: Optional[torch.Generator] = None,
        steps: Optional[int] = None,
        seed: Optional[int] = None,
        distributed: bool = False,
        secure_mode: bool = False,
        **dataloader_kwargs: Any,
    ):
        self._bands = bands
        super().__init__(
            dataset, sample_rate=sample_rate, collate_fn=collate_fn, generator=generator, steps=steps, seed=seed,
            distributed=distributed, secure_mode=secure_mode, **dataloader_kwargs,
        )

    def _batch_sampler(self, num_samples: int, sample_rate: float, **options: Any) -> CyclicPoissonBatchSampler:
        return CyclicPoissonBatchSampler(num_samples, sample_rate, bands=self._bands, **options)

    @property
    def bands(self) -> int:
        return self.batch_sampler.bands

    def hand_out(self, position: Optional[int], size: Optional[int]) -> None:
        plan = self.privacy_plan
        if plan is not None and position is not None and hasattr(plan, "check_partition"):
            plan.check_partition(self.batch_sampler.partition_of(position), self.bands)
        super().hand_out(position, size)

    @classmethod
    def from_data_loader(
        cls,
        data_loader: DataLoader,
        *,
        bands: int,
        generator: Optional[torch.Generator] = None,
        distributed: bool = False,
        seed: Optional[int] = None,
        secure_mode: bool = False,
    ) -> "CyclicPoissonDataLoader":
        """Cyclic Poisson batches of the loader's expected size: q_p = b / len(data_loader)."""
        check_map_style(data_loader.dataset)
        try:
            num_batches = len(data_loader)
        except TypeError as error:
            raise ValueError("the source DataLoader has no length, so its batch size is unknown; build "
                             "CyclicPoissonDataLoader(dataset, sample_rate=..., bands=...) directly") from error
        if num_batches == 0:
            raise ValueError("the source DataLoader yields no batches")
        if bands > num_batches:
            raise ValueError(
                f"{bands} bands need at least {bands} batches per epoch (each partition holds 1/{bands} of the data "
                f"and the loader has {num_batches} batches): use bands <= {num_batches} or a smaller batch_size"
            )
        return cls(
            data_loader.dataset, sample_rate=bands / num_batches, bands=bands, collate_fn=data_loader.collate_fn,
            generator=generator, seed=seed, distributed=distributed, secure_mode=secure_mode,
            **worker_settings(data_loader),
        )


__all__ = ["CyclicPoissonBatchSampler", "CyclicPoissonDataLoader", "partitions"]
