"""PRVAccountant: privacy random variables composed numerically (Gopi et al. 2021)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

from dptorch.accounting.base import Accountant, Run, merge_runs
from dptorch.accounting.privacy_random_variable import (
    ADD,
    REMOVE,
    EpsilonBounds,
    compose_losses,
    epsilon_bounds,
)
from dptorch.accounting.validation import check_delta, check_positive

# Automatic epsilon error: this fraction of a coarse first estimate of epsilon (at least of 1).
_RELATIVE_EPSILON_ERROR = 1e-3
_COARSE_EPSILON_ERROR = 0.1
# Automatic delta error: this fraction of delta.
_RELATIVE_DELTA_ERROR = 1e-3


class PRVAccountant(Accountant):
    """Privacy random variable accountant with proven error bounds (Gopi, Lee, Wutschitz 2021).

    An independent implementation of the same quantity as :class:`PLDAccountant` (both
    directions of the sampled Gaussian, FFT composition). ``get_epsilon`` returns the proven
    upper bound; :meth:`get_epsilon_bounds` also gives the estimate and the lower bound.
    ``eps_error`` (default: 0.1% of epsilon, at least 0.001) widens the bounds but makes the
    FFT smaller; ``delta_error`` (default: delta / 1000) is the delta slack of the bounds.
    Slower than PLD for long runs (the grid shrinks like 1/sqrt(steps)).
    """

    mechanism = "prv"

    def __init__(self, eps_error: Optional[float] = None, delta_error: Optional[float] = None) -> None:
        super().__init__()
        self.eps_error = None if eps_error is None else check_positive(eps_error, "eps_error")
        self.delta_error = None if delta_error is None else check_positive(delta_error, "delta_error")

    def get_epsilon_bounds(self, delta: float) -> EpsilonBounds:
        """(lower, estimate, upper) epsilon at ``delta``; the true epsilon lies in [lower, upper]."""
        delta = check_delta(delta)
        if not self._history:
            return EpsilonBounds(0.0, 0.0, 0.0)
        key = ("bounds", delta)
        if key not in self._epsilon_cache:
            self._epsilon_cache[key] = self._bounds(merge_runs(self._history), delta)  # type: ignore[assignment]
        return self._epsilon_cache[key]  # type: ignore[return-value]

    def _bounds(self, runs: Tuple[Run, ...], delta: float) -> EpsilonBounds:
        delta_error = self.delta_error if self.delta_error is not None else _RELATIVE_DELTA_ERROR * delta
        if delta_error >= delta / 2:
            raise ValueError(f"delta_error must be below delta / 2 = {delta / 2:g}, got {delta_error:g}")
        eps_error = self.eps_error
        if eps_error is None:
            coarse = self._bounds_for(runs, delta, delta_error, _COARSE_EPSILON_ERROR)
            eps_error = _RELATIVE_EPSILON_ERROR * max(coarse.estimate, 1.0)
        return self._bounds_for(runs, delta, delta_error, eps_error)

    @staticmethod
    def _bounds_for(runs: Tuple[Run, ...], delta: float, delta_error: float, eps_error: float) -> EpsilonBounds:
        total_steps = sum(count for _, _, count in runs)
        # Hoeffding gets half of delta_error (see compose_losses); solve t(mesh) = eps_error.
        mesh = eps_error / math.sqrt(total_steps / 2 * math.log(2 / (delta_error / 2)))
        directions = [REMOVE] if all(q == 1.0 for _, q, _ in runs) else [REMOVE, ADD]
        composed = [compose_losses(runs, direction, mesh, delta_error) for direction in directions]
        return epsilon_bounds(composed, delta)

    def _compute_epsilon(self, runs: Tuple[Run, ...], delta: float) -> float:
        return self._bounds(runs, delta).upper
