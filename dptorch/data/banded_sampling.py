"""The sampling ``noise_mechanism="bandmf"`` needs: b-min-separated (cyclic Poisson) loaders.

* ``cyclic_data_loader``: the b-min-separated cyclic Poisson loader the amplification theorem
  needs. A plain ``DataLoader`` is rebuilt with the same expected batch size
  (q_p = b / len(loader)); a ``CyclicPoissonDataLoader`` must have b partitions; a plain Poisson
  ``DPDataLoader`` is 1-min-separated only, so it is accepted for b = 1 and refused otherwise.
* ``auto_bands``: ``bands="auto"`` for a loader: the b of lowest expected error
  (:func:`dptorch.noise.banded.mechanism.resolve_auto_bands`) at the rate the loader samples with.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import DataLoader

from dptorch.data.cyclic_poisson import CyclicPoissonDataLoader
from dptorch.data.poisson import DPDataLoader
from dptorch.noise.banded.mechanism import resolve_auto_bands


def auto_bands(data_loader: DataLoader, one_partition: Callable[[], DPDataLoader], *, target_epsilon: float,
               target_delta: float, horizon: Callable[[DPDataLoader], int], accountant: str) -> int:
    """``bands='auto'``: the b of lowest expected prefix-sum error at the target (:func:`choose_bands`).

    ``one_partition()`` builds the run's loader as one partition (Poisson sampling at DP-SGD's rate
    q); ``horizon(loader)`` is the planned number of steps."""
    if isinstance(data_loader, CyclicPoissonDataLoader):
        raise ValueError(
            f"bands='auto' chooses the partitions, but this CyclicPoissonDataLoader already has "
            f"{data_loader.bands}: pass a plain DataLoader, or bands={data_loader.bands}"
        )
    probe = one_partition()
    return resolve_auto_bands(target_epsilon=target_epsilon, target_delta=target_delta, steps=horizon(probe),
                              sample_rate=probe.batch_sampler.sample_rate, accountant=accountant)


def cyclic_data_loader(data_loader: DataLoader, bands: int, poisson_sampling: bool, secure_mode: bool) -> DPDataLoader:
    """A b-min-separated (cyclic Poisson) loader for ``data_loader``; refuses one that is not."""
    if isinstance(data_loader, CyclicPoissonDataLoader):
        if data_loader.bands != bands:
            raise ValueError(
                f"the CyclicPoissonDataLoader has {data_loader.bands} partitions but bands={bands}: the amplified "
                "banded MF accounting needs b-min-separated sampling with b = bands"
            )
        if secure_mode and not data_loader.batch_sampler.secure:
            raise ValueError("secure_mode=True needs a CyclicPoissonDataLoader built with secure_mode=True")
        return data_loader
    if isinstance(data_loader, DPDataLoader):
        if bands == 1:
            if secure_mode and not data_loader.batch_sampler.secure:
                raise ValueError("secure_mode=True needs a DPDataLoader built with secure_mode=True")
            return data_loader  # Poisson sampling of the whole data is 1-min-separated
        raise ValueError(
            f"noise_mechanism='bandmf' with bands={bands} needs b-min-separated sampling, but this DPDataLoader "
            "Poisson-samples the whole dataset at every step (a sample may appear in consecutive steps), which the "
            "amplified banded MF theorem does not cover. Pass a plain DataLoader (it is rebuilt as cyclic Poisson "
            "sampling) or a dptorch.data.cyclic_poisson.CyclicPoissonDataLoader(..., bands=b)"
        )
    if not poisson_sampling:
        raise ValueError("poisson_sampling=False is refused: bandmf needs cyclic Poisson sampling")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return CyclicPoissonDataLoader.from_data_loader(data_loader, bands=bands, distributed=distributed,
                                                    secure_mode=secure_mode)


__all__ = ["auto_bands", "cyclic_data_loader"]
