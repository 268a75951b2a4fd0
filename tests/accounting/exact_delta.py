"""Reference deltas of a k-fold composed PLD PMF with no absolute rounding floor (test helpers).

An FFT composition rounds every entry of the composed PMF with an absolute error set by its
largest ones (~1e-18 each, ~1e-14 summed over a tail, for hundreds of steps): a delta far below
that cannot be read from it. Two ways around it, one for checking the other:

- ``tilted_delta``: exponential tilting. ``p_t(l) = p(l) e^(t l) / M(t)`` is composed by FFT
  (dp_accounting's ``common.self_convolve``), then ``p^(*k)(l) = M(t)^k e^(-t l) p_t^(*k)(l)``. The
  FFT's absolute error lives in the tilted units, so above epsilon it is multiplied by at most
  ``M(t)^k e^(-t epsilon)``, the Chernoff bound's own scale divided by ``c(t) >= 1 / (e (1 + t))``:
  the delta comes out with an error of at most ``e (1 + t) 1e-13`` times the Chernoff bound.
- ``direct_delta``: direct convolution (no FFT). Every term is a product of non-negative numbers,
  so each entry carries a relative error of at most ``k n u`` (n: the one-step length, u: 1.1e-16).
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import common
from scipy import optimize, special

#: The tilted composition's truncated tails (in tilted units): negligible against the bound's scale.
TILTED_TAIL_MASS = 1e-30


def _losses(probs: np.ndarray, lower_loss: int, interval: float) -> np.ndarray:
    return (lower_loss + np.arange(len(probs))) * interval


def _chernoff_tilt(probs: np.ndarray, losses: np.ndarray, count: int, epsilon: float) -> float:
    """The t > 0 that minimises the Chernoff exponent (convex in t), or 0 where no tilt is needed."""
    def exponent(log_t: float) -> float:
        t = math.exp(log_t)
        with np.errstate(over="ignore", divide="ignore"):  # as below
            log_mgf = special.logsumexp(t * losses, b=probs)
        return t * log_t - (1 + t) * math.log1p(t) - t * epsilon + count * log_mgf

    if epsilon <= count * float(np.dot(probs, losses)):  # epsilon at or below the mean: no tilt needed
        return 0.0
    return math.exp(optimize.minimize_scalar(exponent, bounds=(math.log(1e-3), math.log(5e3)), method="bounded").x)


def tilted_delta(probs: np.ndarray, lower_loss: int, interval: float, count: int, epsilon: float) -> float:
    """Finite part of the delta of ``count`` untruncated self-convolutions of a PMF on a loss grid."""
    probs = np.asarray(probs, dtype=np.float64)
    losses = _losses(probs, lower_loss, interval)
    t = _chernoff_tilt(probs, losses, count, epsilon)
    with np.errstate(over="ignore", divide="ignore"):  # logsumexp divides by the weight of its largest term
        log_m = special.logsumexp(t * losses, b=probs)
        tilted = np.exp(np.log(probs) + t * losses - log_m)
        start, composed = common.self_convolve(tilted, count, tail_mass_truncation=TILTED_TAIL_MASS)
    total = (count * lower_loss + start + np.arange(len(composed))) * interval
    above = total > epsilon
    weights = -np.expm1(epsilon - total[above])
    return float(np.sum(weights * composed[above] * np.exp(count * log_m - t * total[above])))


def direct_delta(probs: np.ndarray, lower_loss: int, interval: float, count: int, epsilon: float) -> float:
    """The same by direct convolution, dropping partial sums that can no longer exceed epsilon."""
    probs = np.asarray(probs, dtype=np.float64)
    top = lower_loss + len(probs) - 1  # the largest one-step loss, in grid units
    state, start = np.ones(1), 0
    for step in range(1, count + 1):
        state, start = np.convolve(state, probs), start + lower_loss
        cut = math.floor(epsilon / interval - (count - step) * top) - 1 - start
        if cut >= len(state):
            return 0.0  # no partial sum can exceed epsilon any more
        if cut > 0:
            state, start = state[cut:], start + cut
    total = (start + np.arange(len(state))) * interval
    above = total > epsilon
    return float(np.dot(-np.expm1(epsilon - total[above]), state[above]))
