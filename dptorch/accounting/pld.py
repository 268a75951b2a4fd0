"""PLDAccountant: privacy loss distributions via Google's ``dp_accounting`` (the default)."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Tuple

from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution

from dptorch.accounting.base import Accountant, Run, merge_runs, warn_if_unresolved
from dptorch.accounting.validation import check_non_negative, check_positive

# The discretisation interval is this fraction of the standard deviation of one step's
# privacy loss, q * sqrt(exp(1 / sigma^2) - 1), clipped to the range below.
_INTERVAL_PER_LOSS_STD = 0.05
_MIN_INTERVAL = 1e-5
_MAX_INTERVAL = 1e-3


def step_loss_std(noise_multiplier: float, sample_rate: float) -> float:
    """Approximate standard deviation of the privacy loss of one sampled Gaussian step."""
    return sample_rate * math.sqrt(math.expm1(min(1.0 / noise_multiplier**2, 700.0)))


def automatic_discretization_interval(runs: Tuple[Run, ...]) -> float:
    """Interval that keeps the pessimistic PLD within ~0.03% of the exact epsilon.

    The rounding error of the connect-the-dots PLD scales with the interval relative to the
    spread of one step's privacy loss, so the interval follows that spread (smallest run wins).
    Measured against a 20x finer grid over sigma 0.5-10, q 5e-4-1, 5-1e5 steps: <= 0.03% high.
    """
    spread = min(step_loss_std(sigma, q) for sigma, q, _ in runs)
    return min(max(_INTERVAL_PER_LOSS_STD * spread, _MIN_INTERVAL), _MAX_INTERVAL)


def dp_event_for_runs(runs: Tuple[Run, ...]) -> dp_event.DpEvent:
    """The ``dp_accounting`` event of the composition of the runs (Poisson-sampled Gaussians)."""
    events = []
    for sigma, q, count in runs:
        gaussian = dp_event.GaussianDpEvent(noise_multiplier=sigma)
        step = gaussian if q == 1.0 else dp_event.PoissonSampledDpEvent(sampling_probability=q, event=gaussian)
        events.append(dp_event.SelfComposedDpEvent(event=step, count=count))
    return events[0] if len(events) == 1 else dp_event.ComposedDpEvent(events=events)


@lru_cache(maxsize=32)
def sampled_gaussian_pld(
    noise_multiplier: float, sample_rate: float, interval: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of one Poisson-sampled Gaussian step (add-or-remove neighbours, pessimistic rounding)."""
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        sampling_prob=sample_rate,
        value_discretization_interval=interval,
    )


def composed_pld(runs: Tuple[Run, ...], interval: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of all runs: each single-step PLD self-composed by FFT, then the runs composed.

    Equal to ``dp_accounting``'s PLDAccountant on :func:`dp_event_for_runs`, but the single-step
    PLDs are cached (a curve of epsilon against steps builds each only once).
    """
    result = None
    for sigma, q, count in runs:
        if q == 1.0:  # plain Gaussian: composing T steps is one Gaussian with sigma / sqrt(T)
            pld = privacy_loss_distribution.from_gaussian_mechanism(
                standard_deviation=sigma / math.sqrt(count), value_discretization_interval=interval
            )
        else:
            pld = sampled_gaussian_pld(sigma, q, interval).self_compose(count)
        result = pld if result is None else result.compose(pld)
    assert result is not None, "runs must not be empty"
    return result


class PLDAccountant(Accountant):
    """Privacy loss distribution accountant (Google ``dp_accounting``); the default.

    Pessimistic rounding makes the reported epsilon an upper bound; with the automatic
    discretisation (``value_discretization_interval=None``) it is within ~0.03% of exact.
    Self-composition is done by FFT, so 10^5 steps take well under a second.
    """

    mechanism = "pld"

    def __init__(self, value_discretization_interval: Optional[float] = None) -> None:
        super().__init__()
        if value_discretization_interval is not None:
            value_discretization_interval = check_positive(
                value_discretization_interval, "value_discretization_interval"
            )
        self.value_discretization_interval = value_discretization_interval
        self._composed: Optional[Tuple[Tuple[Run, ...], privacy_loss_distribution.PrivacyLossDistribution]] = None

    def _pld_for(self, runs: Tuple[Run, ...]) -> privacy_loss_distribution.PrivacyLossDistribution:
        if self._composed is None or self._composed[0] != runs:
            interval = self.value_discretization_interval or automatic_discretization_interval(runs)
            self._composed = (runs, composed_pld(runs, interval))
        return self._composed[1]

    def _compute_epsilon(self, runs: Tuple[Run, ...], delta: float) -> float:
        return warn_if_unresolved(self._pld_for(runs).get_epsilon_for_delta(delta), delta, self.mechanism)

    def get_delta(self, epsilon: float) -> float:
        """Delta of all recorded steps at the given epsilon."""
        epsilon = check_non_negative(epsilon, "epsilon")
        if not self._history:
            return 0.0
        return float(self._pld_for(merge_runs(self._history)).get_delta_for_epsilon(epsilon))
