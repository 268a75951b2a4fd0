"""Choosing the number of bands: the b with the lowest expected error at the target epsilon.

More bands cancel more noise in the workload (``||W C_b^{-1}||_F^2`` falls with b) but weaken the
amplification: a step samples one of b partitions at rate ``q_p = b q`` and the accounting
composes ``ceil(n / b)`` such steps, so the noise multiplier ``sigma_b`` calibrated for the same
(epsilon, delta) grows with b. With the same expected batch in every step, the expected squared
error of the workload is proportional to

    sigma_b^2 * ||W C_b^{-1}||_F^2

and :func:`choose_bands` returns its minimiser over the candidate band counts. b = 1 is DP-SGD
(``C = I``, ``sigma_1`` calibrated for n steps at rate q): a banded strategy is chosen only where
this error is strictly lower, so the choice is never worse than DP-SGD *by this measure* (which is
the noise's effect on the workload, not the accuracy of a trained model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch

from dptorch.accounting import get_noise_multiplier
from dptorch.noise.banded.accounting import accounted_steps
from dptorch.noise.banded.optimize import SGDWorkload, optimal_banded_strategy

DEFAULT_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class BandChoice:
    """The chosen ``bands`` and, for each candidate b, ``noise_multipliers[b]`` (sigma_b) and
    ``relative_errors[b]`` (``sigma_b^2 ||W C_b^{-1}||_F^2`` over DP-SGD's, so 1.0 at b = 1)."""

    bands: int
    noise_multipliers: Dict[int, float] = field(default_factory=dict)
    relative_errors: Dict[int, float] = field(default_factory=dict)


def choose_bands(
    *,
    target_epsilon: float,
    target_delta: float,
    steps: int,
    sample_rate: float,
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
    workload: Optional[SGDWorkload] = None,
    accountant: str = "pld",
) -> BandChoice:
    """The band count with the lowest expected workload error at ``(target_epsilon, target_delta)``.

    ``sample_rate`` is DP-SGD's q (expected batch over dataset size); b bands sample at ``b q``, so a
    candidate with ``b q > 1`` or ``b > steps`` is skipped. ``workload`` defaults to the prefix sum.
    """
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    workload = workload or SGDWorkload()
    usable = sorted({1, *(int(b) for b in candidates if 1 <= b <= steps and b * sample_rate <= 1)})
    choice = BandChoice(bands=1)
    errors = {}
    for b in usable:
        sigma = get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                     sample_rate=min(1.0, b * sample_rate), steps=accounted_steps(steps, b),
                                     accountant=accountant)
        band = optimal_banded_strategy(steps, b, workload=workload).tensor()
        choice.noise_multipliers[b] = sigma
        errors[b] = sigma ** 2 * float(workload.error(band, steps))
    choice.relative_errors = {b: error / errors[1] for b, error in errors.items()}
    choice.bands = min(usable, key=lambda b: (errors[b], b))
    return choice


__all__ = ["BandChoice", "DEFAULT_CANDIDATES", "choose_bands"]
