"""PLDAccountant: agreement with dp_accounting's own event composition, accuracy, bounds."""

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from dptorch.accounting import PLDAccountant, RDPAccountant
from dptorch.accounting.gdp import gdp_epsilon
from dptorch.accounting.pld import automatic_discretization_interval


def _pld(history, **options):
    accountant = PLDAccountant(**options)
    for sigma, q, count in history:
        accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=count)
    return accountant


def test_changing_sigma_and_q_compose_like_dp_accounting_events():
    history = [(1.1, 0.01, 300), (2.0, 0.05, 200), (0.9, 1.0, 7)]
    ours = _pld(history)
    interval = automatic_discretization_interval(tuple(history))
    reference = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    reference.compose(
        dp_event.ComposedDpEvent(
            [
                dp_event.SelfComposedDpEvent(
                    dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1)), 300
                ),
                dp_event.SelfComposedDpEvent(
                    dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(2.0)), 200
                ),
                dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(0.9), 7),
            ]
        )
    )
    assert ours.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)


def test_history_order_and_splitting_do_not_matter():
    split = _pld([(1.1, 0.01, 100), (2.0, 0.05, 200), (1.1, 0.01, 200)])
    merged = _pld([(2.0, 0.05, 200), (1.1, 0.01, 300)])
    assert split.history == [[1.1, 0.01, 100], [2.0, 0.05, 200], [1.1, 0.01, 200]]
    assert split.get_epsilon(1e-5) == pytest.approx(merged.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize(
    "sigma,q,steps",
    [(1.5, 0.04, 2250), (1.1, 0.01, 10_000), (0.8, 0.004, 10_000), (4.0, 0.5, 100), (1.0, 1.0, 10)],
)
def test_pld_is_tighter_than_rdp(sigma, q, steps):
    history = [(sigma, q, steps)]
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    assert _pld(history).get_epsilon(1e-5) <= rdp.get_epsilon(1e-5)


def test_automatic_interval_is_within_a_tenth_of_a_percent_of_a_finer_grid():
    history = [(1.5, 0.04, 500)]
    automatic = _pld(history).get_epsilon(1e-5)
    fine = _pld(history, value_discretization_interval=automatic_discretization_interval(tuple(history)) / 10)
    assert fine.get_epsilon(1e-5) <= automatic <= fine.get_epsilon(1e-5) * 1.001


def test_full_batch_matches_the_analytic_gaussian_mechanism():
    # 10 steps of sigma 1 are one Gaussian mechanism with sigma 1/sqrt(10), i.e. exactly
    # sqrt(10)-GDP, whose (eps, delta) curve is closed form.
    exact = gdp_epsilon(math.sqrt(10), 1e-5)
    assert exact <= _pld([(1.0, 1.0, 10)]).get_epsilon(1e-5) <= exact * (1 + 1e-4)


def test_get_delta_inverts_get_epsilon():
    accountant = _pld([(1.1, 0.02, 500)])
    epsilon = accountant.get_epsilon(1e-6)
    assert accountant.get_delta(epsilon) == pytest.approx(1e-6, rel=1e-3)
    assert accountant.get_delta(epsilon * 1.1) < 1e-6
