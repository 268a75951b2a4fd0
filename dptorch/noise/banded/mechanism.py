"""How ``noise_mechanism="bandmf", bands=b`` becomes a plan and a noise source (the sampling it
needs: :mod:`dptorch.data.banded_sampling`).

* ``resolve_auto_bands``: ``bands="auto"`` (``make_private_with_epsilon``, the HF Trainer): the b of
  lowest expected error.
* ``_mechanism_fields``: the plan fields (``mechanism``, ``strategy``): the optimised band for the
  planned steps n.
* ``attach_banded_noise``: the optimizer's noise generator becomes a :class:`BandedNoise` around it.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from dptorch.noise.banded.choose import choose_bands
from dptorch.noise.banded.optimize import optimal_banded_strategy
from dptorch.noise.banded.streaming import BandedNoise

#: Names ``make_private(noise_mechanism=...)`` accepts.
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
            "dptorch.noise.banded.choose_bands and pass bands=b"
        )
    if not isinstance(bands, int) or isinstance(bands, bool) or bands < 1:
        raise ValueError(f"noise_mechanism='bandmf' needs bands, a whole number >= 1 (or 'auto' with a target "
                         f"epsilon), got {bands!r}")
    return bands


def resolve_auto_bands(*, target_epsilon: float, target_delta: float, steps: int, sample_rate: float,
                       accountant: str) -> int:
    """The b :func:`choose_bands` picks for ``steps`` steps at DP-SGD's ``sample_rate`` q (logged with the errors)."""
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


def attach_banded_noise(optimizer: Any, plan: Any) -> None:
    """Make ``optimizer`` add ``C^{-1} z`` (streamed, state in its state dict) instead of ``z``."""
    if getattr(optimizer, "_sharded", False):
        raise ValueError("bandmf noise is not supported with sharded (FSDP2) parameters yet; use independent noise")
    if not isinstance(optimizer.noise_generator, BandedNoise):
        optimizer.noise_generator = BandedNoise(plan.strategy, optimizer.noise_generator, plan)


__all__ = ["NOISE_MECHANISMS", "attach_banded_noise", "resolve_auto_bands"]
