"""Exact epsilon of one Poisson-sampled Gaussian step in the remove direction (a test oracle).

With mu = (1-q) N(0, s^2) + q N(1, s^2) and mu0 = N(0, s^2), the privacy loss is increasing in
x, so delta(eps) = mu(X > x_eps) - e^eps mu0(X > x_eps), with x_eps where the loss equals eps.
Both tails come from ``log_ndtr`` (no underflow for any sigma), and eps at a given delta by
bisection. The remove direction alone gives a lower bound on the true epsilon: an accountant
that reports less understates it.
"""

from __future__ import annotations

import math

from scipy.optimize import brentq
from scipy.special import log_ndtr


def remove_delta(epsilon: float, sigma: float, q: float) -> float:
    """delta(eps) of one step, remove direction, exactly (up to floating point)."""
    log_excess = epsilon + math.log(-math.expm1(math.log1p(-q) - epsilon)) if q < 1 else epsilon
    x = sigma**2 * (log_excess - math.log(q)) + 0.5
    log_q_tail = log_ndtr(-x / sigma)
    log_p_tail = (math.log1p(-q) + log_q_tail if q < 1 else -math.inf)
    log_p_tail = max(log_p_tail, math.log(q) + log_ndtr((1 - x) / sigma)) + math.log1p(
        math.exp(-abs(log_p_tail - (math.log(q) + log_ndtr((1 - x) / sigma))))
    )
    gap = epsilon + log_q_tail - log_p_tail
    return math.exp(log_p_tail) * -math.expm1(gap) if gap < 0 else 0.0


def remove_epsilon(delta: float, sigma: float, q: float) -> float:
    """The epsilon at which :func:`remove_delta` equals ``delta`` (0 if it is below at 0)."""
    if remove_delta(0.0, sigma, q) <= delta:
        return 0.0
    hi = 1.0
    while remove_delta(hi, sigma, q) > delta:
        hi *= 2
    return brentq(lambda eps: remove_delta(eps, sigma, q) - delta, hi / 2 if hi > 1 else 0.0, hi, rtol=1e-13)
