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
    # The order changes only the FFT's rounding: delta by at most its floor (measured <= 4e-14 here,
    # 1e-13 taken), epsilon by that over |d delta / d epsilon| = 8.5e-5: 1.2e-9, 7e-10 relative.
    assert split.get_epsilon(1e-5) == pytest.approx(merged.get_epsilon(1e-5), rel=1e-9)


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


# -- per-step queries ------------------------------------------------------------------------------


def _step_by_step(sigma, q, steps, delta=1e-5):
    accountant, values = PLDAccountant(), []
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
        values.append(accountant.get_epsilon(delta))
    return values


@pytest.mark.parametrize("sigma,q", [(1.0, 0.05), (0.7, 0.2)])
def test_epsilon_after_every_step_equals_one_query_after_the_same_steps(sigma, q):
    values = _step_by_step(sigma, q, 70)
    for count in (1, 2, 15, 16, 17, 33, 69, 70):  # around the batched and power-of-two boundaries
        once = _pld([(sigma, q, count)])
        assert once.get_epsilon(1e-5) == values[count - 1], count
    assert values == sorted(values)


@pytest.mark.parametrize("sigma,q,count", [(1.0, 0.05, 70), (2.02, 1 / 12, 240), (0.8, 0.004, 400), (4.0, 0.5, 100)])
def test_one_run_agrees_with_dp_accountings_composition_from_scratch(sigma, q, count):
    from dptorch.accounting.pld import composed_pld

    runs = ((sigma, q, count),)
    reference = composed_pld(runs, automatic_discretization_interval(runs)).get_epsilon_for_delta(1e-5)
    assert _pld([runs[0]]).get_epsilon(1e-5) == pytest.approx(reference, rel=1e-7)


def test_step_by_step_queries_never_recompose_from_scratch(monkeypatch):
    from dp_accounting.pld import privacy_loss_distribution

    accountant = PLDAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.05)
    accountant.get_epsilon(1e-5)
    calls = []
    original = privacy_loss_distribution.PrivacyLossDistribution.self_compose
    monkeypatch.setattr(privacy_loss_distribution.PrivacyLossDistribution, "self_compose",
                        lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    for _ in range(40):
        accountant.step(noise_multiplier=1.0, sample_rate=0.05)
        accountant.get_epsilon(1e-5)
    assert calls == []


def test_a_step_by_step_query_costs_a_fraction_of_a_composition_from_scratch():
    import time

    from dptorch.accounting.pld import composed_pld

    _step_by_step(2.02, 1 / 12, 20)  # the one-step PLD is built (and cached) once
    start = time.perf_counter()
    _step_by_step(2.02, 1 / 12, 160)
    per_query = (time.perf_counter() - start) / 160
    start = time.perf_counter()
    for count in (150, 155, 160):
        runs = ((2.02, 1 / 12, count),)
        composed_pld(runs, automatic_discretization_interval(runs)).get_epsilon_for_delta(1e-5)
    from_scratch = (time.perf_counter() - start) / 3
    assert per_query < from_scratch / 4  # measured: about 1/30


def test_truncation_bounds_are_dp_accountings():
    from dp_accounting.pld import common

    from dptorch.accounting.pld import _SelfComposition, sampled_gaussian_pld

    for sigma, q in [(2.02, 1 / 12), (0.8, 0.004), (4.0, 0.5)]:
        pld = sampled_gaussian_pld(sigma, q, automatic_discretization_interval(((sigma, q, 1),)))
        for pmf in (pld._pmf_remove, pld._pmf_add):
            ours, probs = _SelfComposition(pmf), pmf.to_dense_pmf()._probs
            for count in (1, 7, 240, 10_000):
                assert ours.bounds(count) == common.compute_self_convolve_bounds(probs, count, 1e-15)


def test_vectorised_epsilon_search_matches_dp_accountings_loop():
    import numpy as np
    from dp_accounting.pld import pld_pmf

    from dptorch.accounting.pld import epsilon_for_delta

    rng = np.random.default_rng(0)
    for size, lower, infinity in [(500, -100, 0.0), (3000, -2000, 1e-9), (40, 0, 1e-15)]:
        probs = rng.random(size) ** 8
        probs /= probs.sum() * (1 + 1e-3)
        pmf = pld_pmf.DensePLDPmf(1e-3, lower, probs, infinity, True)
        for delta in (1e-2, 1e-5, 1e-8):
            expected = pmf.get_epsilon_for_delta(delta)
            assert epsilon_for_delta(pmf, delta) == pytest.approx(expected, rel=1e-12, abs=1e-12)
            assert epsilon_for_delta(pmf, delta, start_near=expected * 0.9) == epsilon_for_delta(pmf, delta)


# -- the bound that skips the add direction ---------------------------------------------------------
#
# The FFT composition rounds every entry of the composed PMF with an absolute error set by its largest
# entries: at sigma 1.1, q 0.01, 600 steps the negative entries (pure rounding: exact masses are >= 0)
# add up to 3.3e-14. A delta far below that cannot be read from the FFT's value, so the bound is held
# to the exact delta of the same PMF, from exact_delta.py (exponential tilting, checked against direct
# convolution).


@pytest.mark.parametrize("sigma,q,count", [(2.02, 1 / 12, 240), (1.1, 0.01, 600), (4.0, 0.5, 100)])
def test_the_bound_that_skips_the_add_direction_is_an_upper_bound(sigma, q, count):
    """The bound holds for the exact composed PMF; the FFT's value of a tiny delta is rounding.

    At sigma 1.1, q 0.01, 600 steps, epsilon 3, ``add.delta`` reads 2.18e-14 (2e-15 of it the
    truncation allowance) against the bound's 3.0e-15; the exact delta of the same PMF is 3.9e-60
    (exponential tilting and direct convolution agree), and mpmath's Chernoff bound on the continuous
    mechanism gives at most 4e-59. So the bound was right and the test asked for more than floating
    point gives. The tilted reference errs by at most e (1 + t) 1e-13 of the Chernoff scale (t <= 5e3:
    1.4e-9 relative), the one tolerance below; the measured Chernoff/exact ratios are >= 1.59, and a
    bound half as large, or computed on losses one grid step lower, fails here.
    """
    from dptorch.accounting.pld import _SelfComposition, sampled_gaussian_pld

    from tests.accounting.exact_delta import tilted_delta

    pld = sampled_gaussian_pld(sigma, q, automatic_discretization_interval(((sigma, q, count),)))
    add = _SelfComposition(pld._pmf_add)
    infinity = -math.expm1(count * math.log1p(-add.infinity_mass))  # without the truncation allowances
    for epsilon in (0.5, 1.0, 3.0, 6.0):
        exact = tilted_delta(add.probs, add.lower_loss, add.discretization, count, epsilon)
        assert exact <= add.chernoff_delta(count, epsilon) * (1 + 1e-8), epsilon
        assert exact + infinity <= add.delta_bound(count, epsilon), epsilon
        if exact > 1e-6:  # far above the FFT's floor (<= 1e-13, 1e-7 of it): the reference reads the same PMF
            assert add.delta(count, epsilon) == pytest.approx(exact + add.composed_infinity_mass(count), rel=1e-6)


def test_the_exact_delta_reference_agrees_with_direct_convolution():
    """Tilting against a convolution with no FFT (non-negative terms: <= k n u = 3e-12 relative),
    also where the FFT's value is only rounding (epsilon 6: exact 1.2e-32, FFT 1.8e-15)."""
    from dptorch.accounting.pld import _SelfComposition, sampled_gaussian_pld

    from tests.accounting.exact_delta import direct_delta, tilted_delta

    pld = sampled_gaussian_pld(1.0, 0.2, 1e-2)
    for pmf, epsilons in ((pld._pmf_add, (0.5, 4.0, 6.0)), (pld._pmf_remove, (6.0,))):
        one_step = _SelfComposition(pmf)
        for epsilon in epsilons:
            args = (one_step.probs, one_step.lower_loss, one_step.discretization, 30, epsilon)
            direct = direct_delta(*args)
            assert direct > 0
            assert tilted_delta(*args) == pytest.approx(direct, rel=1e-9), epsilon
