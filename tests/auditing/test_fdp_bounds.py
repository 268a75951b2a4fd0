"""The f-DP one-run bound (Mahloujifar, Melis and Chaudhuri 2025) beside Steinke et al.'s, on scores."""

import math

import numpy as np
import pytest
from scipy import special

from dptorch.accounting.gdp import gdp_delta, gdp_epsilon
from dptorch.auditing import bounds_from_scores, fdp_one_run_epsilon, one_run_epsilon
from dptorch.auditing.fdp import gaussian_mu


@pytest.mark.parametrize("epsilon, delta", [(0.0, 1e-5), (0.5, 1e-5), (2.0, 1e-6), (8.0, 1e-5)])
def test_gaussian_mu_is_the_curve_exactly_epsilon_delta_dp(epsilon, delta):
    mu = gaussian_mu(epsilon, delta)
    assert gdp_delta(epsilon, mu) == pytest.approx(delta, rel=1e-9)
    if epsilon == 0:  # delta(0; mu) = 2 Phi(mu / 2) - 1
        assert mu == pytest.approx(2 * special.ndtri((1 + delta) / 2), rel=1e-9)


def test_both_bounds_are_zero_at_chance_and_f_dp_is_tighter_where_guesses_are_good():
    assert fdp_one_run_epsilon(1000, 100, 50, 1e-5, 0.05) == 0.0 == one_run_epsilon(1000, 100, 50, 1e-5, 0.05)
    for m, k, c in [(1000, 100, 90), (1000, 500, 400), (200, 50, 50), (10000, 1000, 800)]:
        steinke, fdp = one_run_epsilon(m, k, c, 1e-5, 0.05), fdp_one_run_epsilon(m, k, c, 1e-5, 0.05)
        assert 0 < steinke < fdp
    more = [fdp_one_run_epsilon(1000, 100, c, 1e-5, 0.05) for c in (70, 80, 90, 100)]
    assert more == sorted(more) and len(set(more)) == 4


def test_a_gaussian_mechanism_is_refuted_at_its_true_epsilon_at_most_as_often_as_the_confidence_allows():
    """Scores of a mu-GDP mechanism (in: N(mu, 1), out: N(0, 1)): the f-DP bound exceeds the true epsilon in
    at most about 5% of runs at 95% confidence, and reaches about half of it with 1000 canaries, well above
    Steinke et al.'s bound on the same guesses."""
    mu, delta, m = 1.0, 1e-5, 1000
    truth = gdp_epsilon(mu, delta)  # 4.377
    rng = np.random.default_rng(0)
    fdp, steinke = [], []
    for _ in range(60):
        included = rng.random(m) < 0.5
        scores = rng.standard_normal(m) + mu * included
        found = bounds_from_scores(scores, included, delta=delta, num_guesses=100)
        fdp.append(found["fdp"]["epsilon_lower_bound"])
        steinke.append(found["steinke"]["epsilon_lower_bound"])
    assert sum(bound > truth for bound in fdp) <= 6  # P[Binomial(60, 0.05) > 6] < 0.05
    assert np.median(fdp) > 0.4 * truth and np.median(fdp) > 1.3 * np.median(steinke)


def test_bounds_from_scores_reports_both_on_the_same_grid_of_guesses():
    rng = np.random.default_rng(1)
    included = rng.random(500) < 0.5
    scores = rng.standard_normal(500) + 3.0 * included
    found = bounds_from_scores(scores, included, delta=1e-5, confidence=0.95)
    assert found["grid"] == [10, 20, 50, 100, 200, 500]
    assert found["significance_per_test"] == pytest.approx(0.05 / 6)
    for name in ("steinke", "fdp"):
        best = found[name]
        assert best["epsilon_lower_bound"] == max(t["epsilon_lower_bound"] for t in best["guesses"])
        assert [t["guesses"] for t in best["guesses"]] == found["grid"]
    assert 0 < found["steinke"]["epsilon_lower_bound"] < found["fdp"]["epsilon_lower_bound"] < math.inf
    with pytest.raises(ValueError, match="not finite"):
        bounds_from_scores([0.0, float("nan")], [True, False], delta=1e-5)
