"""How the engine turns ``noise_mechanism="bandmf", bands=b`` into a sampler, a plan and a noise source.

* ``cyclic_data_loader``: the b-min-separated cyclic Poisson loader the theorem needs. A plain
  ``DataLoader`` is rebuilt with the same expected batch size (q_p = b / len(loader)); a
  ``CyclicPoissonDataLoader`` must have b partitions; a plain Poisson ``DPDataLoader`` is
  1-min-separated only, so it is accepted for b = 1 and refused otherwise.
* ``auto_bands`` / ``resolve_auto_bands``: ``bands="auto"`` (``make_private_with_epsilon``, the HF
  Trainer): the b of lowest expected error.
* ``_mechanism_fields``: the plan fields (``mechanism``, ``strategy``): the optimised band for the
  planned steps n.
* ``attach_banded_noise``: the optimizer's noise generator becomes a :class:`BandedNoise` around it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils.data import DataLoader

from dptorch.data.cyclic_poisson import CyclicPoissonDataLoader
from dptorch.data.poisson import DPDataLoader
from dptorch.noise_mechanisms.optimize import optimal_banded_strategy
from dptorch.noise_mechanisms.streaming import BandedNoise

NOISE_MECHANISMS = ("independent", "bandmf")

logger = logging.getLogger(__name__)


def _check_mechanism(noise_mechanism: str, bands: Optional[int]) -> Optional[int]:
    """The bands of a bandmf run (None for independent noise); refuses inconsistent arguments."""
    if noise_mechanism not in NOISE_MECHANISMS:
        raise ValueError(f"noise_mechanism must be one of {NOISE_MECHANISMS}, got {noise_mechanism!r}")
    if noise_mechanism == "independent":
        if bands not in (None, 1):
            raise ValueError(f"bands={bands} is an option of noise_mechanism='bandmf' (independent noise has 1 band)")
        return None
    if bands == "auto":
        raise ValueError(
            "bands='auto' chooses the bands for a target epsilon: use make_private_with_epsilon, or pick b with "
            "dptorch.noise_mechanisms.choose_bands and pass bands=b"
        )
    if not isinstance(bands, int) or isinstance(bands, bool) or bands < 1:
        raise ValueError(f"noise_mechanism='bandmf' needs bands, a whole number >= 1 (or 'auto' with a target "
                         f"epsilon), got {bands!r}")
    return bands


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


def resolve_auto_bands(*, target_epsilon: float, target_delta: float, steps: int, sample_rate: float,
                       accountant: str) -> int:
    """The b :func:`choose_bands` picks for ``steps`` steps at DP-SGD's ``sample_rate`` q (logged with the errors)."""
    from dptorch.noise_mechanisms.choose import choose_bands

    choice = choose_bands(target_epsilon=target_epsilon, target_delta=target_delta, steps=int(steps),
                          sample_rate=sample_rate, accountant=accountant)
    logger.info("bands='auto': %d bands (expected error relative to DP-SGD: %s)", choice.bands,
                ", ".join(f"b={b}: {e:.3f}" for b, e in sorted(choice.relative_errors.items())))
    return choice.bands


def _mechanism_fields(noise_mechanism: str, bands: Optional[int], horizon: int) -> Dict[str, Any]:
    """Plan fields of the mechanism: none for independent noise; the optimised band for bandmf."""
    if noise_mechanism != "bandmf":
        return {}
    if bands > horizon:
        raise ValueError(f"bands={bands} is more than the {horizon} planned steps; use bands <= {horizon}")
    return {"mechanism": "bandmf", "strategy": optimal_banded_strategy(int(horizon), bands)}


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


def attach_banded_noise(optimizer: Any, plan: Any) -> None:
    """Make ``optimizer`` add ``C^{-1} z`` (streamed, state in its state dict) instead of ``z``."""
    if getattr(optimizer, "_sharded", False):
        raise ValueError("bandmf noise is not supported with sharded (FSDP2) parameters yet; use independent noise")
    if not isinstance(optimizer.noise_generator, BandedNoise):
        optimizer.noise_generator = BandedNoise(plan.strategy, optimizer.noise_generator, plan)


__all__ = ["NOISE_MECHANISMS", "attach_banded_noise", "cyclic_data_loader"]
