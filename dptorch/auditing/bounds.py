"""Epsilon lower bounds from guesses about canaries (Steinke, Nasr and Jagielski 2023).

One training run, ``m`` canaries, each included independently with probability 1/2. After the
run the auditor guesses, from what it observed, "in" or "out" for ``r`` of them and abstains on
the rest. If the run is (epsilon, delta)-DP with respect to each canary, the number ``W`` of
correct guesses satisfies, for every ``v`` (the paper's main theorem, approximate-DP form):

    P[W >= v] <= f(v) + 2 m delta * max_{i = 1..v} (f(v - i) - f(v)) / i,
    f(k) = P[Binomial(r, e^eps / (1 + e^eps)) >= k]

(with ``f(k) = 1`` for ``k <= 0``). Seeing ``v`` correct guesses whose bound is at most
``1 - confidence`` refutes that epsilon; the audited lower bound is the largest epsilon so refuted
(0 when none is). The bound is monotone in epsilon, so it is found by bisection.

Guessing: the ``r`` canaries with the most extreme scores (``ceil(r/2)`` highest guessed "in",
``floor(r/2)`` lowest guessed "out"). ``r`` is either given, or chosen from a fixed grid after
seeing the scores, in which case every ``r`` of the grid is tested at significance
``(1 - confidence) / len(grid)`` (Bonferroni), so the reported bound keeps the stated confidence.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np
from scipy import optimize, special, stats

_EPSILON_CAP = 100.0


def one_run_p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float) -> float:
    """Probability, under (epsilon, delta)-DP, of at least ``num_correct`` right among ``num_guesses`` guesses."""
    r, v = int(num_guesses), int(num_correct)
    if v <= 0:
        return 1.0
    q = float(special.expit(epsilon))
    beta = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[W >= v]
    if delta == 0:
        return beta
    shifts = np.arange(1, v + 1)
    tails = stats.binom.sf(v - shifts - 1, r, q)  # f(v - i); 1 once v - i <= 0
    alpha = max(float(np.max((tails - beta) / shifts)), 0.0)
    return min(1.0, beta + 2.0 * num_canaries * delta * alpha)


def one_run_epsilon(num_canaries: int, num_guesses: int, num_correct: int, delta: float, significance: float) -> float:
    """The largest epsilon that ``num_correct`` right among ``num_guesses`` refutes at ``significance`` (0 if none)."""
    if not 0 < significance < 1:
        raise ValueError(f"significance must be in (0, 1), got {significance}")

    def excess(eps: float) -> float:
        return significance - one_run_p_value(num_canaries, num_guesses, num_correct, eps, delta)

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        if high >= _EPSILON_CAP:
            return math.inf  # refuted at every epsilon we can tell apart in float64
        high *= 2.0
    return float(optimize.brentq(excess, 0.0, high, xtol=1e-6))


def guess_grid(num_canaries: int) -> List[int]:
    """Numbers of guesses tried when none is given: 10, 20, 50, 100, 200, 500, ... below m, and m."""
    grid, scale = [], 1
    while True:
        for step in (10, 20, 50):
            r = step * scale
            if r >= num_canaries:
                return grid + [num_canaries]
            grid.append(r)
        scale *= 10


def epsilon_lower_bound(
    scores: Sequence[float],
    included: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    num_guesses: Optional[int] = None,
) -> Dict[str, object]:
    """The audited epsilon lower bound of one run from the canaries' scores and true inclusion.

    Returns ``epsilon_lower_bound``, ``confidence``, ``num_canaries``, ``num_guesses`` and
    ``num_correct`` (of the best number of guesses) and ``guesses`` (every number tried, with its
    correct count and bound at its significance).
    """
    scores = np.asarray(scores, dtype=np.float64)
    truth = np.asarray(included, dtype=bool)
    if scores.shape != truth.shape or scores.ndim != 1 or scores.size == 0:
        raise ValueError("scores and included must be two 1-D sequences of the same, non-zero length")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    m = scores.size
    grid = [int(num_guesses)] if num_guesses is not None else guess_grid(m)
    if any(not 1 <= r <= m for r in grid):
        raise ValueError(f"num_guesses must be in [1, {m}], got {num_guesses}")
    significance = (1.0 - confidence) / len(grid)
    order = np.argsort(-scores, kind="stable")  # highest score first
    tried = []
    for r in grid:
        guess_in, guess_out = order[: (r + 1) // 2], order[m - r // 2 :] if r // 2 else order[:0]
        correct = int(truth[guess_in].sum() + (~truth[guess_out]).sum())
        bound = one_run_epsilon(m, r, correct, delta, significance)
        tried.append({"guesses": r, "correct": correct, "epsilon_lower_bound": bound})
    best = max(tried, key=lambda t: (t["epsilon_lower_bound"], -t["guesses"]))
    return {
        "epsilon_lower_bound": best["epsilon_lower_bound"],
        "confidence": confidence,
        "delta": delta,
        "num_canaries": m,
        "num_guesses": best["guesses"],
        "num_correct": best["correct"],
        "significance_per_test": significance,
        "guesses": tried,
    }


__all__ = ["epsilon_lower_bound", "guess_grid", "one_run_epsilon", "one_run_p_value"]
