"""Epsilon lower bounds from the f-DP one-run audit (Mahloujifar, Melis and Chaudhuri, ICML 2025).

The same experiment as Steinke, Nasr and Jagielski's (:mod:`dptorch.auditing.bounds`): ``m``
canaries, each included with probability 1/2, ``k`` guesses "in", ``c`` of them right. Instead
of refuting ``(epsilon, delta)``-DP, it refutes a whole trade-off curve ``f`` (the type II error
of the best test at each type I error), which is far more than two numbers say; the curve tested
here is the Gaussian one that is exactly ``(epsilon, delta)``-DP (mu-GDP with
``delta(epsilon; mu) = delta``), so the result is again an epsilon at ``delta`` and sits beside
Steinke's. It is the bound JAX Privacy's auditor reports as ``epsilon_one_run_fdp``.

The test (the paper's bound on the probability of ``c`` right guesses, in its recursive form):
start from the masses ``right = alpha c / m`` and ``wrong = alpha (k - c) / m`` (``alpha`` the
significance); for ``i = c - 1`` down to 0 the curve forces ``wrong >= f(1 - right)``, and
every rise of ``wrong`` lets ``right`` grow by ``i / (k - i)`` times as much (capped at 1). A run
that satisfies the curve makes ``c`` right guesses with probability at most ``alpha`` when the
masses end above ``k / m``: then the curve is refuted at significance ``alpha``. The masses only
shrink as ``epsilon`` grows (the curve rises), so the refuted epsilons are an interval from 0 and
the bound is found by root finding.
"""

from __future__ import annotations

import math
from typing import Callable

from scipy import optimize, special

from dptorch.accounting.gdp import gdp_delta

_EPSILON_CAP = 100.0
_XTOL = 1e-6  # the bound's precision (as Steinke's in bounds.py)


def gaussian_mu(epsilon: float, delta: float) -> float:
    """The mu of the Gaussian trade-off curve that is exactly ``(epsilon, delta)``-DP."""
    if not (epsilon >= 0 and 0 < delta < 1):
        raise ValueError(f"need epsilon >= 0 and delta in (0, 1), got epsilon={epsilon}, delta={delta}")
    low = high = 1.0
    while gdp_delta(epsilon, high) < delta:  # delta(epsilon; mu) grows with mu
        low, high = high, high * 2.0
    while gdp_delta(epsilon, low) > delta:
        low, high = low / 2.0, low
    return float(optimize.brentq(lambda mu: gdp_delta(epsilon, mu) - delta, low, high, xtol=1e-300, rtol=1e-14))


def gaussian_least_wrong(mu: float) -> Callable[[float], float]:
    """``x -> f(1 - x) = Phi(Phi^-1(x) - mu)``, for mu-GDP's curve ``f(alpha) = Phi(Phi^-1(1 - alpha) - mu)`` (the
    least type II error at type I error ``alpha``), written without forming ``1 - x``."""
    return lambda x: float(special.ndtr(special.ndtri(x) - mu))


def excess_mass(num_canaries: int, num_guesses: int, num_correct: int, significance: float,
                least_wrong: Callable[[float], float]) -> float:
    """How far the masses of the recursion (module docstring) end above ``k / m``; > 0 refutes the curve ``f``
    given as ``least_wrong(x) = f(1 - x)``."""
    m, k, c = int(num_canaries), int(num_guesses), int(num_correct)
    right = significance * c / m
    wrong = significance * (k - c) / m
    for i in range(c - 1, -1, -1):
        forced = max(wrong, least_wrong(right))
        if forced == wrong:  # nothing rises now, so nothing rises later either
            break
        right = min(right + i / (k - i) * (forced - wrong), 1.0)
        wrong = forced
    return right + wrong - k / m


def fdp_one_run_epsilon(num_canaries: int, num_guesses: int, num_correct: int, delta: float,
                        significance: float) -> float:
    """The largest epsilon whose Gaussian ``(epsilon, delta)`` curve ``c`` right of ``k`` refutes (0 if none)."""
    if not 0 < significance < 1:
        raise ValueError(f"significance must be in (0, 1), got {significance}")
    if not 0 <= num_correct <= num_guesses <= num_canaries or num_guesses < 1:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries and guesses >= 1, got "
                         f"{num_correct}, {num_guesses}, {num_canaries}")

    def excess(eps: float) -> float:
        return excess_mass(num_canaries, num_guesses, num_correct, significance,
                           gaussian_least_wrong(gaussian_mu(eps, delta)))

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        if high >= _EPSILON_CAP:
            return math.inf
        high *= 2.0
    return float(optimize.brentq(excess, 0.0, high, xtol=_XTOL))


__all__ = ["excess_mass", "fdp_one_run_epsilon", "gaussian_least_wrong", "gaussian_mu"]
