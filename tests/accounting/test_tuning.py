"""The privacy of releasing the best of K trials (dptorch.accounting.tuning), against dp-accounting's own
composition of ``RepeatAndSelectDpEvent`` and against the published pure-DP overheads."""

import math
import random

import numpy as np
import pytest

from dptorch.accounting.rdp import RDPAccountant
from dptorch.accounting.sampled_gaussian_rdp import DEFAULT_ORDERS, rdp_to_epsilon
from dptorch.accounting.tuning import (
    POISSON,
    gamma_for_mean,
    rdp_to_delta,
    repeat_and_select_rdp,
    trial_count,
    truncated_negative_binomial_mean,
    tuning_epsilon,
)

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import dp_event  # noqa: E402
from dp_accounting.rdp import rdp_privacy_accountant as theirs  # noqa: E402

#: (sigma, q, steps, expected trials, shape, delta): Poisson, logarithmic, geometric, fractional and larger shapes.
SETTINGS = [
    (1.0, 0.01, 1000, 10, POISSON, 1e-5),
    (1.2, 0.02, 500, 5, POISSON, 1e-5),
    (1.0, 0.01, 1000, 10, 0, 1e-5),
    (0.8, 0.05, 200, 30, 1, 1e-6),
    (2.0, 0.001, 5000, 100, 0.5, 1e-5),
    (0.6, 0.1, 50, 50, 2, 1e-5),
]
INTEGER_ORDERS = tuple(range(2, 257))


def _trial_event(sigma, q, steps):
    return dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)


def _their_epsilon(event, orders, delta):
    accountant = theirs.RdpAccountant(list(orders))
    accountant.compose(event)
    return accountant.get_epsilon(delta)


def _our_rdp(sigma, q, steps, orders):
    accountant = RDPAccountant(orders)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_rdp()


@pytest.mark.parametrize("sigma, q, steps, mean, shape, delta", SETTINGS)
def test_the_selection_bound_equals_dp_accountings_on_the_same_curve(sigma, q, steps, mean, shape, delta):
    """One trial's RDP curve from dp-accounting itself: the selection and the conversion are compared alone.
    Its gamma comes from a bisection to 1e-9 relative, ours to 1e-15; nothing else may differ."""
    single = theirs.RdpAccountant(list(DEFAULT_ORDERS))
    single.compose(_trial_event(sigma, q, steps))
    expected = _their_epsilon(dp_event.RepeatAndSelectDpEvent(_trial_event(sigma, q, steps), mean, shape),
                              DEFAULT_ORDERS, delta)
    assert tuning_epsilon(single._rdp, DEFAULT_ORDERS, delta, mean, shape) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("sigma, q, steps, mean, shape, delta", SETTINGS)
def test_dp_sgd_trials_end_to_end_equal_dp_accountings_composition(sigma, q, steps, mean, shape, delta):
    """dptorch's own RDP of the trial (integer orders: both sides sum the same finite series) through the selection."""
    event = dp_event.RepeatAndSelectDpEvent(_trial_event(sigma, q, steps), mean, shape)
    ours = tuning_epsilon(_our_rdp(sigma, q, steps, INTEGER_ORDERS), INTEGER_ORDERS, delta, mean, shape)
    assert ours == pytest.approx(_their_epsilon(event, INTEGER_ORDERS, delta), rel=1e-9)


def test_the_selection_costs_more_than_one_trial_and_grows_with_the_trials():
    rdp = _our_rdp(1.0, 0.01, 1000, DEFAULT_ORDERS)
    one = rdp_to_epsilon(rdp, DEFAULT_ORDERS, 1e-5)[0]
    for shape in (POISSON, 0, 1):
        costs = [tuning_epsilon(rdp, DEFAULT_ORDERS, 1e-5, mean, shape) for mean in (2, 10, 100)]
        assert one < costs[0] < costs[1] < costs[2]


@pytest.mark.parametrize("shape", [0, 0.5, 1, 2])
def test_pure_dp_trials_give_the_published_2_plus_shape_epsilon(shape):
    """Papernot and Steinke: an eps-DP trial, K truncated negative binomial of shape eta, gives ((2 + eta) eps)-DP
    (geometric K: 3 eps, Liu and Talwar 2019). A pure eps-DP mechanism is (lambda, eps)-RDP at every order, and
    the RDP at order -> infinity is the pure epsilon; at order 2^39 the log terms are below 1e-10."""
    epsilon = 0.7
    orders = np.array([2.0 ** k for k in range(1, 40)])
    bound = repeat_and_select_rdp(np.full(orders.shape, epsilon), orders, 10, shape)
    assert bound[-1] == pytest.approx((2 + shape) * epsilon, abs=1e-9)


def test_the_delta_conversion_inverts_the_epsilon_conversion():
    rdp = _our_rdp(1.0, 0.01, 1000, DEFAULT_ORDERS)
    epsilon = rdp_to_epsilon(rdp, DEFAULT_ORDERS, 1e-5)[0]
    assert rdp_to_delta(rdp, DEFAULT_ORDERS, epsilon) == pytest.approx(1e-5, rel=1e-6)
    assert rdp_to_delta(rdp, DEFAULT_ORDERS, epsilon) == pytest.approx(
        theirs.compute_delta(DEFAULT_ORDERS, rdp, epsilon)[0], rel=1e-12)


@pytest.mark.parametrize("shape", [0, 0.5, 1, 3])
def test_gamma_gives_the_asked_mean(shape):
    for mean in (1.5, 10, 100):
        assert truncated_negative_binomial_mean(gamma_for_mean(mean, shape), shape) == pytest.approx(mean, rel=1e-12)


@pytest.mark.parametrize("mean, shape", [(10, POISSON), (10, 0), (10, 1), (30, 2)])
def test_the_drawn_trial_counts_follow_the_distribution(mean, shape):
    """The inversion's draws: their mean within 5 standard errors of E[K]; K = 0 only for Poisson, as often as e^-mu."""
    rng = random.Random(1234)
    draws = np.array([trial_count(mean, shape, rng.random() or 0.5) for _ in range(20000)])
    assert abs(draws.mean() - mean) < 5 * draws.std() / math.sqrt(draws.size)
    if shape == POISSON:
        assert abs(draws.var() - mean) < 0.1 * mean
    else:
        assert draws.min() == 1
    small = trial_count(2, POISSON, math.exp(-2) * 0.999)  # the inversion's first step is P[K = 0] = e^-mu
    assert (small, trial_count(2, POISSON, math.exp(-2) * 1.001)) == (0, 1)


def test_a_geometric_count_is_the_inverse_of_its_distribution_function():
    gamma = gamma_for_mean(4, 1)
    for k in (1, 2, 5):
        cdf = 1 - (1 - gamma) ** k
        assert trial_count(4, 1, cdf * (1 - 1e-9)) == k
        assert trial_count(4, 1, cdf * (1 + 1e-9)) == k + 1


@pytest.mark.parametrize("mean, shape", [(0.5, POISSON), (math.nan, 1), (10, -1), (10, math.nan)])
def test_invalid_trial_distributions_are_refused(mean, shape):
    with pytest.raises(ValueError):
        repeat_and_select_rdp([1.0], [2.0], mean, shape)
