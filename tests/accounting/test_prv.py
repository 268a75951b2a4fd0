"""PRVAccountant: an independent numerical method that must agree with PLD, with proven bounds."""

import math

import pytest

from dptorch.accounting import EpsilonBounds, PLDAccountant, PRVAccountant
from dptorch.accounting.gdp import gdp_epsilon

TYPICAL = [(1.5, 0.04, 2250), (1.1, 0.01, 3000), (0.8, 0.004, 2000), (4.0, 0.5, 100), (2.0, 0.01, 1000)]


def _run(cls, sigma, q, steps, **options):
    accountant = cls(**options)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant


@pytest.mark.parametrize("sigma,q,steps", TYPICAL)
def test_prv_agrees_with_pld_within_half_a_percent(sigma, q, steps):
    prv = _run(PRVAccountant, sigma, q, steps).get_epsilon(1e-5)
    pld = _run(PLDAccountant, sigma, q, steps).get_epsilon(1e-5)
    assert prv == pytest.approx(pld, rel=5e-3)


@pytest.mark.parametrize("sigma,q,steps", TYPICAL[:3])
def test_bounds_bracket_the_estimate_and_pld(sigma, q, steps):
    bounds = _run(PRVAccountant, sigma, q, steps).get_epsilon_bounds(1e-5)
    assert isinstance(bounds, EpsilonBounds)
    assert bounds.lower <= bounds.estimate <= bounds.upper
    # PLD's pessimistic epsilon is an upper bound too, and close to exact: inside the bracket.
    assert bounds.lower <= _run(PLDAccountant, sigma, q, steps).get_epsilon(1e-5) <= bounds.upper * 1.001
    assert bounds.upper - bounds.lower < 0.01 * bounds.upper


def test_get_epsilon_is_the_upper_bound():
    accountant = _run(PRVAccountant, 1.1, 0.01, 1000)
    assert accountant.get_epsilon(1e-5) == accountant.get_epsilon_bounds(1e-5).upper


def test_full_batch_matches_the_analytic_gaussian_mechanism():
    bounds = _run(PRVAccountant, 1.0, 1.0, 10).get_epsilon_bounds(1e-5)
    assert bounds.lower <= gdp_epsilon(math.sqrt(10), 1e-5) <= bounds.upper


def test_changing_sigma_and_q_compose():
    history = [(1.1, 0.01, 300), (2.0, 0.05, 200), (0.9, 1.0, 7)]
    prv, pld = PRVAccountant(), PLDAccountant()
    for sigma, q, count in history:
        for accountant in (prv, pld):
            accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=count)
    assert prv.get_epsilon(1e-5) == pytest.approx(pld.get_epsilon(1e-5), rel=5e-3)


def test_curve_fast_path_matches_step_by_step():
    accountant = PRVAccountant()
    curve = accountant.epsilons_after(noise_multiplier=1.1, sample_rate=0.01, steps=[0, 200, 1000], delta=1e-5)
    assert curve[0] == 0.0
    for count, epsilon in zip([200, 1000], curve[1:]):
        direct = _run(PRVAccountant, 1.1, 0.01, count).get_epsilon(1e-5)
        assert epsilon == pytest.approx(direct, rel=2e-3)


def test_explicit_errors_widen_or_narrow_the_bounds():
    loose = _run(PRVAccountant, 1.1, 0.01, 1000, eps_error=0.1).get_epsilon_bounds(1e-5)
    tight = _run(PRVAccountant, 1.1, 0.01, 1000, eps_error=0.005).get_epsilon_bounds(1e-5)
    assert loose.upper - loose.lower > tight.upper - tight.lower
    assert loose.estimate == pytest.approx(tight.estimate, rel=1e-3)


def test_delta_error_must_be_below_delta():
    accountant = _run(PRVAccountant, 1.1, 0.01, 10, delta_error=1e-6)
    with pytest.raises(ValueError, match="delta_error"):
        accountant.get_epsilon(1e-6)


def test_epsilons_of_thousands_stay_finite_and_exact():
    # 3000 full-batch steps at sigma 0.3: exactly mu-GDP with mu = sqrt(3000) / 0.3.
    bounds = _run(PRVAccountant, 0.3, 1.0, 3000).get_epsilon_bounds(1e-5)
    exact = gdp_epsilon(math.sqrt(3000) / 0.3, 1e-5)
    assert exact > 1000
    assert bounds.lower <= exact <= bounds.upper


def test_bounds_widen_near_the_double_precision_floor():
    accountant = _run(PRVAccountant, 1.1, 0.01, 3000)
    usual, tiny = accountant.get_epsilon_bounds(1e-5), accountant.get_epsilon_bounds(1e-12)
    assert (tiny.upper - tiny.lower) / tiny.upper > (usual.upper - usual.lower) / usual.upper
