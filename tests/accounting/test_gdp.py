"""GDPAccountant: a labelled approximation that warns on every construction."""

import math
import warnings

import pytest

from dptorch.accounting import GDPAccountant, GDPApproximationWarning, PLDAccountant
from dptorch.accounting.gdp import clt_mu, gdp_delta, gdp_epsilon


def test_warns_every_time_it_is_constructed():
    with warnings.catch_warnings(record=True) as caught:
        for _ in range(3):
            GDPAccountant()
    messages = [w for w in caught if issubclass(w.category, GDPApproximationWarning)]
    assert len(messages) == 3
    assert "not a bound" in str(messages[0].message)
    assert "far below the true epsilon" in str(messages[0].message)


def test_is_not_a_bound_it_can_be_far_below_pld():
    with pytest.warns(GDPApproximationWarning):
        gdp = GDPAccountant()
    pld = PLDAccountant()
    for accountant in (gdp, pld):
        accountant.step(noise_multiplier=0.6, sample_rate=0.004, num_steps=1000)
    assert gdp.get_epsilon(1e-5) < 0.6 * pld.get_epsilon(1e-5)


def test_epsilon_solves_the_gdp_delta_equation():
    for mu in (0.1, 0.5, 1.0, 3.0):
        epsilon = gdp_epsilon(mu, 1e-5)
        assert gdp_delta(epsilon, mu) == pytest.approx(1e-5, rel=1e-6)


def test_clt_mu_formula():
    assert clt_mu(((2.0, 0.01, 400),)) == pytest.approx(0.01 * math.sqrt(400 * math.expm1(0.25)))
    # Runs add their mu^2; full batch uses the exact T / sigma^2.
    assert clt_mu(((2.0, 0.01, 400), (1.0, 1.0, 4))) == pytest.approx(math.sqrt(0.01**2 * 400 * math.expm1(0.25) + 4))
