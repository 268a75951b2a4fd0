"""The one-run audit: the binomial bound, and the two runs (correct: below the claim; broken clipping: above)."""

import json

import numpy as np
import pytest
import torch
from scipy import stats

from dptorch.auditing import audit_dp_sgd, epsilon_lower_bound, one_run_epsilon, one_run_p_value
from dptorch.cli import main as cli_main


def test_p_value_is_the_binomial_tail_for_pure_dp_and_grows_with_epsilon_and_delta():
    tail = stats.binom.sf(39, 50, np.exp(1.0) / (1 + np.exp(1.0)))  # P[Bin(50, e/(1+e)) >= 40]
    assert one_run_p_value(500, 50, 40, 1.0, 0.0) == pytest.approx(tail, rel=1e-12)
    values = [one_run_p_value(500, 50, 40, eps, 1e-5) for eps in (0.0, 0.5, 1.0, 2.0)]
    assert values == sorted(values) and values[2] > tail  # the delta term only adds
    assert one_run_p_value(500, 50, 0, 0.0, 1e-5) == 1.0


def test_bound_is_zero_at_chance_and_large_for_perfect_guesses():
    assert one_run_epsilon(1000, 100, 50, 1e-5, 0.05) == 0.0
    perfect = one_run_epsilon(1000, 100, 100, 1e-5, 0.05)
    # 100 of 100 right: without delta the bound solves p^100 = 0.05, p = e^eps / (1 + e^eps); delta lowers it
    p = 0.05 ** (1 / 100)
    assert 3.0 < perfect < np.log(p / (1 - p)) == pytest.approx(3.49, abs=0.01)
    rng = np.random.default_rng(0)
    included = rng.random(400) < 0.5
    random = epsilon_lower_bound(rng.standard_normal(400), included, delta=1e-5)
    separated = epsilon_lower_bound(included * 10.0 + rng.standard_normal(400), included, delta=1e-5)
    assert random["epsilon_lower_bound"] < 0.5 < 2.0 < separated["epsilon_lower_bound"]
    assert separated["num_correct"] == separated["num_guesses"] and separated["num_canaries"] == 400
    assert [t["guesses"] for t in separated["guesses"]] == [10, 20, 50, 100, 200, 400]  # Bonferroni over 6 tests
    assert separated["significance_per_test"] == pytest.approx(0.05 / 6)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_correct_private_run_audits_below_its_claimed_epsilon(seed, one_thread):
    result = audit_dp_sgd(num_canaries=500, noise_multiplier=4.0, steps=4, seed=seed)
    assert result.claimed_epsilon == pytest.approx(1.99, abs=0.02)
    assert result.consistent and result.epsilon_lower_bound < result.claimed_epsilon
    assert 0 <= result.fdp_epsilon_lower_bound < result.claimed_epsilon
    assert result.num_canaries == 500 and 200 < result.num_included < 300


def test_broken_clipping_is_caught_by_the_audit(monkeypatch, one_thread):
    # Test-only switch: the optimizer's clip factors become 1, so each canary (raw norm 10 C) passes unclipped.
    monkeypatch.setattr("dptorch.optim.optimizer.clip_factors",
                        lambda norms, bound: torch.ones_like(norms, dtype=torch.float32))
    result = audit_dp_sgd(num_canaries=500, noise_multiplier=4.0, steps=4, seed=0)
    assert result.claimed_epsilon == pytest.approx(1.99, abs=0.02)
    assert not result.consistent and result.epsilon_lower_bound > result.claimed_epsilon + 1
    assert result.fdp_epsilon_lower_bound > result.claimed_epsilon + 1


def test_the_result_refutes_the_claim_when_either_bound_exceeds_it():
    from dataclasses import replace

    from dptorch.auditing.canaries import AuditResult

    below = AuditResult(epsilon_lower_bound=0.5, claimed_epsilon=2.0, delta=1e-5, confidence=0.95, num_canaries=500,
                        num_included=250, num_guesses=200, num_correct=144, fdp_epsilon_lower_bound=0.6,
                        fdp_num_guesses=100, fdp_num_correct=72)
    assert below.consistent
    assert not replace(below, fdp_epsilon_lower_bound=2.1).consistent
    assert not replace(below, epsilon_lower_bound=2.1).consistent


def test_the_audit_command_reports_json_and_draws_the_plot(tmp_path, capsys, one_thread):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "audit.png"
    code = cli_main(["audit", "--canaries", "200", "--noise-multiplier", "3,6", "--steps", "2",
                     "--grad-sample-mode", "bk", "--json", "--plot", str(plot)])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and plot.stat().st_size > 1000 and payload["plot"] == str(plot)
    first, second = payload["runs"]
    assert first["settings"]["noise_multiplier"] == 3.0 and first["claimed_epsilon"] > second["claimed_epsilon"]
    for run in payload["runs"]:
        assert run["num_canaries"] == 200 and run["confidence"] == 0.95 and run["consistent"] is True
        assert 0 <= run["epsilon_lower_bound"] < run["claimed_epsilon"]
        assert 0 <= run["fdp_epsilon_lower_bound"] < run["claimed_epsilon"] and run["fdp_num_guesses"] >= 10
        assert {"guesses", "correct", "epsilon_lower_bound"} == set(run["guesses"][0])
    assert cli_main(["audit", "--noise-multiplier", "0"]) == 2


def test_the_audit_command_prints_both_bounds_of_the_same_scores(capsys, one_thread):
    assert cli_main(["audit", "--canaries", "200", "--steps", "2", "--seed", "3"]) == 0
    line = capsys.readouterr().out
    result = audit_dp_sgd(num_canaries=200, steps=2, seed=3, grad_sample_mode="auto")
    assert f">= {result.epsilon_lower_bound:.4g} (Steinke et al.: {result.num_correct} of {result.num_guesses}" in line
    assert f">= {result.fdp_epsilon_lower_bound:.4g} (f-DP: {result.fdp_num_correct} of {result.fdp_num_guesses}" in line
