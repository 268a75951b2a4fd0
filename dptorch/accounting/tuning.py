"""The privacy of tuning: run a random number K of independent trials and release only the best.

Pure functions. Papernot and Steinke, "Hyperparameter Tuning with Renyi Differential Privacy"
(ICLR 2022): if one trial is (lambda, eps(lambda))-RDP at every order, releasing the best of K
trials is RDP with

* K truncated negative binomial (shape eta >= 0, halting probability gamma; eta = 0 is the
  logarithmic distribution, eta = 1 the geometric), Theorem 2:
  eps'(lambda) = eps(lambda) + (1 + eta) * min over lambda_hat of [(1 - 1/lambda_hat) eps(lambda_hat)
  + log(1/gamma) / lambda_hat] + log(E[K]) / (lambda - 1);
* K Poisson with mean mu (``shape = POISSON``), Theorem 6:
  eps'(lambda) = eps(lambda) + mu * delta_hat + log(mu) / (lambda - 1), where the trial is
  (eps_hat, delta_hat)-DP at eps_hat = log(1 + 1 / (lambda - 1)).

RDP grows with the order, so each order's bound is also lowered to the smallest bound of any
higher order. dp-accounting composes the same event (``RepeatAndSelectDpEvent(event, mean, shape)``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from dptorch.accounting.sampled_gaussian_rdp import rdp_to_epsilon

#: ``shape`` of the Poisson distribution of the number of trials (the limit of large shapes).
POISSON = math.inf


def check_trials(mean: float, shape: float) -> None:
    """Refuse a mean below 1 or a shape that is negative or NaN (dp-accounting's domain)."""
    if not (isinstance(mean, (int, float)) and math.isfinite(mean) and mean >= 1):
        raise ValueError(f"the expected number of trials must be a finite number >= 1, got {mean!r}")
    if not (isinstance(shape, (int, float)) and shape >= 0):
        raise ValueError(f"shape must be >= 0 (0 logarithmic, 1 geometric, math.inf Poisson), got {shape!r}")


def _expm1_over_x(x: float) -> float:
    return 1.0 if x == 0 else math.expm1(x) / x


def truncated_negative_binomial_mean(gamma: float, shape: float) -> float:
    """E[K] of the truncated negative binomial: shape * (1 - gamma) / (gamma * (1 - gamma^shape)),
    (1 - gamma) / (gamma * log(1/gamma)) at shape 0."""
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
    if gamma == 1:
        return 1.0
    log_gamma = math.log(gamma)
    return (1 - gamma) / (gamma * -log_gamma * _expm1_over_x(shape * log_gamma))


def gamma_for_mean(mean: float, shape: float) -> float:
    """The halting probability gamma whose truncated negative binomial has E[K] = ``mean`` (bisection;
    of the last bracket the smaller gamma, whose mean is at or above ``mean``)."""
    check_trials(mean, shape)
    if shape == 1:
        return 1 / mean
    low, high = 0.0, 1.0  # the mean falls from infinity at gamma -> 0 to 1 at gamma = 1
    while high - low > 1e-15 * high:
        middle = (low + high) / 2
        if truncated_negative_binomial_mean(middle, shape) < mean:
            high = middle
        else:
            low = middle
    return low if low > 0 else high


def rdp_to_delta(rdp: Sequence[float], orders: Sequence[float], epsilon: float) -> float:
    """The smallest delta at ``epsilon`` the RDP curve proves: per order, the smaller of
    (a - 1)(r - eps + log(1 - 1/a)) - log(a) (Canonne, Kamath and Steinke 2020, Prop. 12; Balle et al.
    2020) and 0.5 log(1 - exp(-r)) (delta <= total variation <= sqrt(1 - exp(-KL)), KL <= r), in logs."""
    r = np.asarray(rdp, dtype=float)
    a = np.asarray(orders, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        by_kl = np.where(r > 0, 0.5 * np.log1p(-np.exp(-r)), -np.inf)
        by_order = (a - 1) * (r - epsilon + np.log1p(-1 / a)) - np.log(a)
    log_delta = np.minimum(by_kl, np.where(np.isnan(by_order), np.inf, by_order))
    return float(min(math.exp(float(np.min(log_delta))), 1.0))


def repeat_and_select_rdp(rdp: Sequence[float], orders: Sequence[float], mean: float, shape: float) -> np.ndarray:
    """RDP at each order of releasing the best of K trials, one trial having RDP ``rdp`` at ``orders`` (all > 1).

    ``mean`` is E[K] (>= 1); ``shape`` the distribution of K: ``POISSON``, or eta >= 0 for the truncated
    negative binomial (0 logarithmic, 1 geometric)."""
    check_trials(mean, shape)
    r = np.asarray(rdp, dtype=float)
    a = np.asarray(orders, dtype=float)
    if r.shape != a.shape or not a.size or np.any(a <= 1):
        raise ValueError("rdp and orders must have the same non-zero length, every order > 1")
    if shape == POISSON:
        delta_hat = np.array([rdp_to_delta(r, a, math.log1p(1 / (order - 1))) for order in a])
        bound = r + mean * delta_hat + math.log(mean) / (a - 1)
    else:
        gamma = gamma_for_mean(mean, shape)
        mean = truncated_negative_binomial_mean(gamma, shape)  # >= the asked mean: conservative
        selection = (1 + shape) * float(np.min((1 - 1 / a) * r - math.log(gamma) / a))
        bound = r + selection + math.log(mean) / (a - 1)
    order_rank = np.argsort(a)
    lowest_above = np.minimum.accumulate(bound[order_rank][::-1])[::-1]  # RDP is monotone in the order
    lowered = np.empty_like(bound)
    lowered[order_rank] = lowest_above
    return lowered


def tuning_epsilon(rdp: Sequence[float], orders: Sequence[float], delta: float, mean: float, shape: float) -> float:
    """Epsilon at ``delta`` of releasing the best of K trials (``repeat_and_select_rdp``, then converted)."""
    return rdp_to_epsilon(repeat_and_select_rdp(rdp, orders, mean, shape), orders, delta)[0]


def trial_count(mean: float, shape: float, uniform: float) -> int:
    """K for the uniform draw ``uniform`` in (0, 1), by inversion of K's distribution: Poisson(``mean``)
    (K may be 0) or the truncated negative binomial of this mean and shape (K >= 1)."""
    check_trials(mean, shape)
    if not 0 < uniform < 1:
        raise ValueError(f"uniform must be in (0, 1), got {uniform!r}")
    if shape == POISSON:
        log_mean = math.log(mean)
        k, total = 0, 0.0
        while True:
            probability = math.exp(k * log_mean - mean - math.lgamma(k + 1))
            total += probability
            if total >= uniform or (k > mean and probability == 0.0):
                return k
            k += 1
    gamma = gamma_for_mean(mean, shape)
    log_gamma = math.log(gamma)
    # P[K = 1] = (1 - gamma) shape / (gamma^-shape - 1); P[K = k + 1] = P[K = k] (1 - gamma) (k + shape) / (k + 1)
    probability = (1 - gamma) / (-log_gamma * _expm1_over_x(-shape * log_gamma)) if gamma < 1 else 1.0
    k, total = 1, probability
    while total < uniform and probability > 0.0:
        probability *= (1 - gamma) * (k + shape) / (k + 1)
        total += probability
        k += 1
    return k
