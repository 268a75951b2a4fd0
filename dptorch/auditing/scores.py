"""Both one-run lower bounds from canary scores: Steinke et al.'s and the f-DP one, on the same guesses.

The guesses are one-sided: the ``k`` canaries of highest score are guessed "in", the auditor
abstains on the rest (the f-DP recursion of :mod:`dptorch.auditing.fdp` is for "in" guesses only,
so Steinke's bound is taken on the same ones). ``k`` runs over a grid fixed before the scores are
seen (:func:`~dptorch.auditing.bounds.guess_grid`: 10, 20, 50, 100, ... and ``m``), each tested at
significance ``(1 - confidence) / len(grid)`` (Bonferroni), so each reported bound keeps the stated
confidence whichever ``k`` gave it. Which ``k`` is tried never depends on which canaries are in.

(JAX Privacy's ``CanaryScoreAuditor`` tries instead every threshold on the convex hull of the ROC
curve and divides the significance by the number of hull points; the hull is found from the
labels, so that number is not fixed in advance. Its bound at one given threshold, which
``tests/auditing/test_jax_privacy.py`` compares with these, is the same test.)
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

from dptorch.auditing.bounds import guess_grid, one_run_epsilon
from dptorch.auditing.fdp import fdp_one_run_epsilon

#: The two bounds, by the name they are reported under.
METHODS = {"steinke": one_run_epsilon, "fdp": fdp_one_run_epsilon}


def top_guesses(scores: Sequence[float], included: Sequence[bool], num_guesses: int) -> int:
    """Right guesses when the ``num_guesses`` highest scores are guessed "in" (ties broken by canary index)."""
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    return int(np.asarray(included, dtype=bool)[order[:num_guesses]].sum())


def bounds_from_scores(
    scores: Sequence[float],
    included: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    num_guesses: Optional[int] = None,
) -> Dict[str, Any]:
    """Steinke et al.'s and the f-DP lower bound on epsilon at ``delta``, each at ``confidence``.

    Returns ``{"steinke": {...}, "fdp": {...}, "confidence", "delta", "num_canaries",
    "significance_per_test", "grid"}``; each method's entry holds ``epsilon_lower_bound`` and the
    ``num_guesses`` / ``num_correct`` that gave it (``guesses``: every ``k`` tried with its bound).
    """
    scores = np.asarray(scores, dtype=np.float64)
    truth = np.asarray(included, dtype=bool)
    if scores.shape != truth.shape or scores.ndim != 1 or scores.size < 2:
        raise ValueError("scores and included must be two 1-D sequences of the same length, at least 2")
    if not np.isfinite(scores).all():
        raise ValueError("a canary score is not finite (inf or NaN): the run's gradients were not finite")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    m = scores.size
    grid = [int(num_guesses)] if num_guesses is not None else guess_grid(m)
    if any(not 1 <= k <= m for k in grid):
        raise ValueError(f"num_guesses must be in [1, {m}], got {num_guesses}")
    significance = (1.0 - confidence) / len(grid)
    correct = {k: top_guesses(scores, truth, k) for k in grid}
    result: Dict[str, Any] = {"confidence": confidence, "delta": delta, "num_canaries": m,
                              "significance_per_test": significance, "grid": grid}
    for name, bound in METHODS.items():
        tried = [{"guesses": k, "correct": correct[k], "epsilon_lower_bound": bound(m, k, correct[k], delta, significance)}
                 for k in grid]
        best = max(tried, key=lambda t: (t["epsilon_lower_bound"], -t["guesses"]))
        result[name] = {"epsilon_lower_bound": best["epsilon_lower_bound"], "num_guesses": best["guesses"],
                        "num_correct": best["correct"], "guesses": tried}
    return result


__all__ = ["METHODS", "bounds_from_scores", "top_guesses"]
