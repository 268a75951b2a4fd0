"""How many grid points a PLD needs, and the sound answer when that is more than memory allows.

A privacy loss distribution on a grid of interval h spans the losses of one step, about
1 / (2 sigma^2) at the top: at sigma 1e-6 that is 5e11 / h points (petabytes). The PLD accountant
asks :func:`step_grid_points` (and the composed length its truncation bounds give) before it
builds anything; above :data:`MAX_STEP_POINTS` or :data:`MAX_COMPOSED_POINTS` it reports the RDP
epsilon (:func:`rdp_epsilon`), an upper bound for every sigma, and warns (:class:`PLDGridWarning`).
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache
from typing import Tuple

import numpy as np
from dp_accounting.pld import privacy_loss_mechanism

from dptorch.accounting.base import Run
from dptorch.accounting.sampled_gaussian_rdp import DEFAULT_ORDERS, rdp_to_epsilon, sampled_gaussian_rdp

#: Points of one step's PLD (per direction) beyond which the PLD accountant does not build it.
#: Building costs ~12 us a point in dp_accounting (2^21 points: ~25 s, once per sigma and q); the
#: largest grid of sigma >= 0.3, q >= 1e-5 measured 1e6 points, so those keep the PLD epsilon.
MAX_STEP_POINTS = 2**21
#: Points of a composed PLD beyond which it is not composed (FFTs and their cached squares: ~1 GiB);
#: 10^5 steps at sigma 1, q 0.1 need 7e5.
MAX_COMPOSED_POINTS = 2**22


class PLDGridWarning(UserWarning):
    """The PLD grid would be too large (a very small noise multiplier): the RDP bound is reported instead."""


@lru_cache(maxsize=256)
def step_grid_points(noise_multiplier: float, sample_rate: float, interval: float) -> float:
    """Grid points of one Poisson-sampled Gaussian step's PLD at ``interval`` (the larger direction),
    from the loss range ``dp_accounting``'s connect-the-dots discretisation covers; computes no PLD
    (but takes ~7 ms: cached)."""
    points = 0.0
    for adjacency in (privacy_loss_mechanism.AdjacencyType.REMOVE, privacy_loss_mechanism.AdjacencyType.ADD):
        loss = privacy_loss_mechanism.GaussianPrivacyLoss(
            noise_multiplier, sampling_prob=sample_rate, adjacency_type=adjacency
        )
        bounds = loss.connect_dots_bounds()
        span = float(bounds.epsilon_upper) - float(bounds.epsilon_lower)
        points = max(points, span / interval if math.isfinite(span) else math.inf)
    return points


def rdp_epsilon(runs: Tuple[Run, ...], delta: float) -> float:
    """The RDP epsilon of ``runs`` over the default orders: an upper bound on the PLD's epsilon."""
    total = sum(count * sampled_gaussian_rdp(sigma, q, DEFAULT_ORDERS) for sigma, q, count in runs)
    return rdp_to_epsilon(total, DEFAULT_ORDERS, delta)[0]


def rdp_delta(runs: Tuple[Run, ...], epsilon: float) -> float:
    """The RDP delta of ``runs`` at ``epsilon`` (the inverse of :func:`rdp_epsilon`'s conversion), at most 1."""
    total = sum(count * sampled_gaussian_rdp(sigma, q, DEFAULT_ORDERS) for sigma, q, count in runs)
    alphas = np.asarray(DEFAULT_ORDERS, dtype=float)
    # log delta(a) = (a - 1) (rdp(a) - epsilon + log(1 - 1/a)) - log(a), from eps(a) of rdp_to_epsilon
    with np.errstate(over="ignore", invalid="ignore"):
        log_delta = (alphas - 1) * (np.asarray(total) - epsilon + np.log1p(-1 / alphas)) - np.log(alphas)
    log_delta = np.where(np.isnan(log_delta), np.inf, log_delta)
    return float(min(1.0, math.exp(min(float(log_delta.min()), 0.0))))


def warn_grid_too_large(runs: Tuple[Run, ...], limit: int) -> None:
    """Say that the PLD is not built and the RDP bound answers instead."""
    smallest = min(sigma for sigma, _, _ in runs)
    warnings.warn(  # the same words at every step count, so that warning filters show it once
        f"the 'pld' accountant would need a grid of more than {limit:,} points for "
        f"noise_multiplier={smallest:g}: it reports the RDP bound instead, an upper bound "
        "(looser than PLD). Below a noise multiplier of about 0.3 epsilon is large whichever accountant counts it; "
        "pass accountant='rdp' (or 'prv') to choose the bound yourself and silence this warning",
        PLDGridWarning,
        stacklevel=5,
    )
