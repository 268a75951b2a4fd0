"""Tiny noise multipliers: every accountant answers in bounded time and memory, never below the
exact one-step epsilon (issue 31: sigma 1e-6 asked the PLD for 3.55 PiB)."""

import math
import time
import warnings

import pytest

from dptorch.accounting import ACCOUNTANTS, RDPAccountant, create_accountant, get_noise_multiplier
from dptorch.accounting.pld_limits import PLDGridWarning, rdp_delta

from .one_step_exact import remove_delta, remove_epsilon

SIGMAS = (1e-6, 1e-3, 1e-2)
DELTA = 1e-5


def _epsilon(name, sigma, q=0.1, steps=1):
    accountant = create_accountant(name)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        epsilon = accountant.get_epsilon(DELTA)
        seconds = time.perf_counter() - start
    return epsilon, seconds, caught


@pytest.mark.parametrize("sigma", SIGMAS)
@pytest.mark.parametrize("name", list(ACCOUNTANTS))
def test_every_accountant_answers_a_tiny_sigma_quickly_and_never_below_the_exact_epsilon(name, sigma):
    epsilon, seconds, _ = _epsilon(name, sigma)
    assert seconds < 5, f"{name} took {seconds:.1f} s at sigma {sigma}"
    exact = remove_epsilon(DELTA, sigma, 0.1)  # the remove direction alone: a lower bound on the truth
    if name == "gdp":  # an approximation, not a bound: it must answer, here with infinity
        assert epsilon == math.inf
    else:
        assert epsilon >= exact * (1 - 1e-12), (name, epsilon, exact)
        assert math.isfinite(epsilon)


@pytest.mark.parametrize("sigma", SIGMAS)
def test_pld_reports_the_rdp_bound_and_says_so_where_its_grid_would_be_too_large(sigma):
    epsilon, _, caught = _epsilon("pld", sigma, steps=10)
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=sigma, sample_rate=0.1, num_steps=10)
    assert epsilon == rdp.get_epsilon(DELTA)
    messages = [str(w.message) for w in caught if issubclass(w.category, PLDGridWarning)]
    assert messages and f"noise_multiplier={sigma:g}" in messages[0] and "RDP bound" in messages[0]


def test_the_oracle_is_the_hockey_stick_divergence():
    # at sigma 1 a large epsilon leaves only the Gaussian tail: the oracle falls with epsilon, is 0 at infinity
    assert remove_delta(0.0, 1.0, 1.0) == pytest.approx(math.erf(0.5 / math.sqrt(2)), rel=1e-12)
    assert remove_delta(3.0, 1.0, 0.1) < remove_delta(2.0, 1.0, 0.1) < remove_delta(1.0, 1.0, 0.1)


def test_pld_delta_falls_back_to_the_rdp_delta_which_is_an_upper_bound():
    accountant = create_accountant("pld")
    accountant.step(noise_multiplier=1e-3, sample_rate=0.1)
    epsilon = remove_epsilon(DELTA, 1e-3, 0.1)
    with pytest.warns(PLDGridWarning):
        delta = accountant.get_delta(epsilon * 2.1)
    assert remove_delta(epsilon * 2.1, 1e-3, 0.1) <= delta <= 1
    assert delta == rdp_delta(((1e-3, 0.1, 1),), epsilon * 2.1)


def test_the_rdp_delta_inverts_the_rdp_epsilon():
    runs = ((0.8, 0.05, 100),)
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=0.8, sample_rate=0.05, num_steps=100)
    assert rdp_delta(runs, rdp.get_epsilon(1e-6)) == pytest.approx(1e-6, rel=1e-6)


def test_calibration_survives_the_fallback_and_meets_the_target_by_the_bound(monkeypatch):
    # a small grid limit makes the PLD fall back at ordinary sigmas, cheaply
    monkeypatch.setattr("dptorch.accounting.pld.MAX_STEP_POINTS", 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PLDGridWarning)  # the search itself stays quiet
        sigma = get_noise_multiplier(target_epsilon=2.0, target_delta=DELTA, sample_rate=0.01, steps=200,
                                     epsilon_tolerance=0.05)
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=sigma, sample_rate=0.01, num_steps=200)
    assert 2.0 * 0.95 <= rdp.get_epsilon(DELTA) <= 2.0


def test_a_plan_with_a_tiny_sigma_reports_a_bound():
    from dptorch.plan import PrivacyPlan

    plan = PrivacyPlan(noise_multiplier=1e-6, sample_rate=0.1, num_units=1000, accountant="pld")
    plan.record_steps(1)
    with pytest.warns(PLDGridWarning):
        assert plan.epsilon(DELTA) >= remove_epsilon(DELTA, 1e-6, 0.1)
