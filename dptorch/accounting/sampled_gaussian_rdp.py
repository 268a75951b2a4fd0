"""Rényi DP of the Poisson-sampled Gaussian mechanism and its conversion to (eps, delta).

Pure functions. Formulas from Mironov, Talwar and Zhang, "Rényi Differential Privacy of the
Sampled Gaussian Mechanism" (2019): with mu0 = N(0, s^2), mu1 = N(1, s^2) and
mu = (1-q) mu0 + q mu1, the RDP of order a is log(A_a) / (a - 1) where
A_a = E_{z ~ mu0}[(mu(z) / mu0(z))^a]. Integer orders use the finite binomial expansion,
fractional orders the two convergent series (Section 3.3); all sums are done in log space.
The conversion to (eps, delta) is Balle et al., "Hypothesis testing interpretations and
Rényi differential privacy" (2020), Theorem 21.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence, Tuple

import numpy as np
from scipy.special import gammaln, gammasgn, log_ndtr, logsumexp

#: Default orders: dense below 11, every integer up to 63, then a few large ones.
DEFAULT_ORDERS: Tuple[float, ...] = tuple(
    [1 + x / 10 for x in range(1, 100)] + list(range(12, 64)) + [80, 96, 128, 192, 256]
)

# The fractional series stops once a term is this many nats below A_a - 1 (the RDP is then
# exact to ~1e-10 relative), or too small to change A_a in double precision at all.
_SERIES_LOG_TOLERANCE = 23.0
_DOUBLE_LOG_RESOLUTION = 38.0
_SERIES_MAX_TERMS = 2_000_000


def _log_binomial(alpha: float, k: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """log|C(alpha, k)| and its sign for real alpha and integer k >= 0."""
    log_abs = gammaln(alpha + 1) - gammaln(k + 1) - gammaln(alpha - k + 1)
    sign = gammasgn(alpha - k + 1)
    return log_abs, sign


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    k = np.arange(alpha + 1, dtype=float)
    log_coef, _ = _log_binomial(float(alpha), k)
    terms = log_coef + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma**2)
    return float(logsumexp(terms))


def _fractional_terms(q: float, sigma: float, alpha: float, k: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Log magnitudes and signs of the k-th terms of both series (A1 + A2) of Mironov et al."""
    z0 = sigma**2 * (math.log1p(-q) - math.log(q)) + 0.5
    log_coef, sign = _log_binomial(alpha, k)
    j = alpha - k
    log_q, log_1mq = math.log(q), math.log1p(-q)
    # 0.5 * erfc(x / (sqrt(2) sigma)) == Phi(-x / sigma); log_ndtr keeps it accurate in the tails.
    first = log_coef + k * log_q + j * log_1mq + (k * k - k) / (2 * sigma**2) + log_ndtr((z0 - k) / sigma)
    second = log_coef + j * log_q + k * log_1mq + (j * j - j) / (2 * sigma**2) + log_ndtr((j - z0) / sigma)
    return np.concatenate([first, second]), np.concatenate([sign, sign])


def _log_a_fractional(q: float, sigma: float, alpha: float) -> float:
    n_terms = 1024
    while True:
        k = np.arange(n_terms, dtype=float)
        log_terms, signs = _fractional_terms(q, sigma, alpha, k)
        log_a, sign = logsumexp(log_terms, b=signs, return_sign=True)
        if sign <= 0:
            raise ArithmeticError(f"RDP series lost precision (q={q}, sigma={sigma}, order={alpha})")
        # The tail alternates in sign with shrinking terms, so the first dropped term bounds it.
        last = max(log_terms[n_terms - 1], log_terms[-1])
        log_a_minus_1 = math.log(max(math.expm1(log_a), 1e-300))
        threshold = max(log_a_minus_1 - _SERIES_LOG_TOLERANCE, log_a - _DOUBLE_LOG_RESOLUTION)
        if last < threshold or n_terms >= _SERIES_MAX_TERMS:
            return float(log_a)
        n_terms *= 4


def _rdp_integer_order(q: float, sigma: float, alpha: int) -> float:
    return max(_log_a_integer(q, sigma, alpha), 0.0) / (alpha - 1)


def _rdp_one_order(q: float, sigma: float, alpha: float) -> float:
    if q == 1.0:
        return alpha / (2 * sigma**2)
    if float(alpha).is_integer():
        return _rdp_integer_order(q, sigma, int(alpha))
    # RDP grows with the order, so the neighbouring integer orders (stable finite sums) bracket
    # the series value; where the alternating series loses precision (small sigma with large
    # orders, q next to 1) the upper neighbour is a safe stand-in.
    upper = _rdp_integer_order(q, sigma, math.ceil(alpha))
    lower = _rdp_integer_order(q, sigma, math.floor(alpha)) if alpha > 2 else 0.0
    try:
        value = max(_log_a_fractional(q, sigma, alpha), 0.0) / (alpha - 1)
    except ArithmeticError:
        return upper
    slack = 1e-9 * upper + 1e-300
    return value if lower - slack <= value <= upper + slack else upper


@lru_cache(maxsize=256)
def _rdp_cached(noise_multiplier: float, sample_rate: float, orders: Tuple[float, ...]) -> np.ndarray:
    values = np.array([_rdp_one_order(sample_rate, noise_multiplier, a) for a in orders])
    values.setflags(write=False)
    return values


def sampled_gaussian_rdp(noise_multiplier: float, sample_rate: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of one step of the Poisson-sampled Gaussian mechanism at each order (> 1)."""
    orders = tuple(float(a) for a in orders)
    if any(not a > 1 for a in orders):
        raise ValueError(f"RDP orders must all be > 1, got {[a for a in orders if not a > 1]}")
    return _rdp_cached(float(noise_multiplier), float(sample_rate), orders)


def rdp_to_epsilon(rdp: Sequence[float], orders: Sequence[float], delta: float) -> Tuple[float, int]:
    """Smallest epsilon over the orders, and the index of the order that achieves it.

    eps(a) = rdp(a) + log((a - 1) / a) - (log(delta) + log(a)) / (a - 1), clipped at 0.
    """
    rdp_values = np.asarray(rdp, dtype=float)
    alphas = np.asarray(orders, dtype=float)
    eps = rdp_values + np.log1p(-1 / alphas) - (math.log(delta) + np.log(alphas)) / (alphas - 1)
    eps = np.where(np.isnan(eps), np.inf, eps)
    best = int(np.argmin(eps))
    return max(float(eps[best]), 0.0), best
