"""PRVAccountant: privacy random variables composed numerically (Gopi et al. 2021)."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from dptorch.accounting.base import Accountant, Run, merge_runs, warn_if_unresolved
from dptorch.accounting.privacy_random_variable import (
    ADD,
    REMOVE,
    EpsilonBounds,
    compose_loss_over_counts,
    compose_losses,
    epsilon_bounds,
)
from dptorch.accounting.sampled_gaussian_rdp import DEFAULT_ORDERS, rdp_to_epsilon, sampled_gaussian_rdp
from dptorch.accounting.validation import check_delta, check_positive

# Automatic epsilon error: this fraction of the RDP epsilon (an upper bound, cheap), at least of 1.
_RELATIVE_EPSILON_ERROR = 1e-3
# Automatic delta error: this fraction of delta.
_RELATIVE_DELTA_ERROR = 1e-3


def _mesh(eps_error: float, total_steps: int, delta_error: float) -> float:
    """Grid step whose Hoeffding rounding bound (with half of delta_error) equals eps_error."""
    return eps_error / math.sqrt(total_steps / 2 * math.log(2 / (delta_error / 2)))


class PRVAccountant(Accountant):
    """Privacy random variable accountant with proven error bounds (Gopi, Lee, Wutschitz 2021).

    An independent implementation of the same quantity as :class:`PLDAccountant` (both
    directions of the sampled Gaussian, FFT composition). ``get_epsilon`` returns the proven
    upper bound; :meth:`get_epsilon_bounds` also gives the estimate and the lower bound.
    ``eps_error`` (default: 0.1% of the RDP epsilon, at least 0.001) widens the bounds but
    makes the FFT smaller; ``delta_error`` (default: delta / 1000) is the delta slack of the bounds.
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

    def get_epsilon(self, delta: float) -> float:
        """Proven upper bound on epsilon at ``delta`` (see :meth:`get_epsilon_bounds`)."""
        return self.get_epsilon_bounds(delta).upper

    def _delta_error(self, delta: float) -> float:
        delta_error = self.delta_error if self.delta_error is not None else _RELATIVE_DELTA_ERROR * delta
        if delta_error >= delta / 2:
            raise ValueError(f"delta_error must be below delta / 2 = {delta / 2:g}, got {delta_error:g}")
        return delta_error

    def _eps_error(self, runs: Tuple[Run, ...], delta: float) -> float:
        if self.eps_error is not None:
            return self.eps_error
        rdp = sum(count * sampled_gaussian_rdp(sigma, q, DEFAULT_ORDERS) for sigma, q, count in runs)
        rdp_epsilon, _ = rdp_to_epsilon(rdp, DEFAULT_ORDERS, delta)
        return _RELATIVE_EPSILON_ERROR * max(rdp_epsilon, 1.0)

    def _bounds(self, runs: Tuple[Run, ...], delta: float) -> EpsilonBounds:
        bounds = self._bounds_for(runs, delta, self._delta_error(delta), self._eps_error(runs, delta))
        warn_if_unresolved(bounds.upper, delta, self.mechanism)
        return bounds

    def _epsilons_after(self, sigma: float, q: float, counts: List[int], delta: float) -> List[float]:
        positive = sorted({count for count in counts if count > 0})
        if self._history or not positive:
            return super()._epsilons_after(sigma, q, counts, delta)
        # One (sigma, q) from scratch: one discretisation and one FFT serve every count.
        delta_error = self._delta_error(delta)
        eps_error = self._eps_error(((sigma, q, positive[-1]),), delta)
        mesh = _mesh(eps_error, positive[-1], delta_error)
        directions = [REMOVE] if q == 1.0 else [REMOVE, ADD]
        per_direction = [compose_loss_over_counts(sigma, q, d, mesh, delta_error, positive) for d in directions]
        upper = {
            count: epsilon_bounds([losses[i] for losses in per_direction], delta).upper
            for i, count in enumerate(positive)
        }
        return [warn_if_unresolved(upper.get(count, 0.0), delta, self.mechanism) for count in counts]

    @staticmethod
    def _bounds_for(runs: Tuple[Run, ...], delta: float, delta_error: float, eps_error: float) -> EpsilonBounds:
        mesh = _mesh(eps_error, sum(count for _, _, count in runs), delta_error)
        directions = [REMOVE] if all(q == 1.0 for _, q, _ in runs) else [REMOVE, ADD]
        composed = [compose_losses(runs, direction, mesh, delta_error) for direction in directions]
        return epsilon_bounds(composed, delta)

    def _compute_epsilon(self, runs: Tuple[Run, ...], delta: float) -> float:
        return self._bounds(runs, delta).upper
