"""Epsilon as a function of the number of steps, for plots and tables."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from dptorch.accounting.factory import create_accountant
from dptorch.accounting.validation import check_delta, check_noise_multiplier, check_sample_rate, check_steps


def step_grid(steps: int, points: int = 41) -> List[int]:
    """Distinct step counts from 0 to ``steps``: ``points`` evenly spaced, plus a few geometric
    ones inside the first interval, where epsilon rises fastest."""
    even = np.linspace(0, steps, max(2, points))
    early = np.geomspace(1, max(1.0, even[1]), 8) if steps > 0 else []
    return sorted({int(round(x)) for x in [*even, *early]})


def epsilon_curve(
    accountant: str,
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    points: int = 41,
) -> Tuple[List[int], List[float]]:
    """(step counts, epsilons) of one accountant from 0 to ``steps`` steps at fixed sigma and q."""
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    total = check_steps(steps)
    delta = check_delta(delta)
    grid = step_grid(total, points)
    counter = create_accountant(accountant)
    return grid, counter.epsilons_after(noise_multiplier=sigma, sample_rate=q, steps=grid, delta=delta)
