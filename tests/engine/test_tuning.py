"""dptorch.tune: K private trials (real PrivacyEngine runs on a tiny model), each checked within the declared
per-trial privacy, and only the best released with the epsilon of the selection beside one trial's."""

import math
import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch.accounting import get_noise_multiplier
from dptorch.accounting.tuning import POISSON, trial_count
from dptorch.engine import PrivacyEngine
from dptorch.tuning import (
    SELECTION_NOT_ACCOUNTED,
    TrialOutcome,
    draw_trial_count,
    history_epsilon,
    selection_report,
    tune,
    tuning_summary,
)

ROWS, BATCH, SIGMA = 64, 16, 1.0
BOUND = [(SIGMA, BATCH / ROWS, ROWS // BATCH)]  # one epoch of Poisson batches at q = 1/4
DELTA = 1e-5


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5, 0.0]) + 0.1 * torch.randn(ROWS, generator=g))


def private_trial(lr, epochs=1, noise_multiplier=SIGMA):
    """Train a linear model privately for ``epochs`` at ``lr``; score it on held-out (non-private) data."""
    model = nn.Linear(4, 1)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(_data(), batch_size=BATCH), noise_multiplier=noise_multiplier, max_grad_norm=1.0)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
            optimizer.step()
    held_out = torch.randn(32, 4)
    with torch.no_grad():
        score = float(nn.functional.mse_loss(model(held_out).squeeze(-1), held_out @ torch.tensor([1.0, -2.0, 0.5, 0.0])))
    return TrialOutcome(output=model, score=score, privacy=engine)


def test_k_trials_run_and_the_best_is_released_with_the_selections_epsilon():
    calls = []

    def run(lr):
        outcome = private_trial(lr)
        calls.append((lr, outcome.score, outcome.output))
        return outcome

    result = tune(run, per_trial=BOUND, expected_trials=4, delta=DELTA, candidates=[0.01, 0.1, 0.5],
                  secure=False, seed=3)
    assert len(calls) == draw_trial_count(4, POISSON, secure=False, seed=3) > 1
    best = min(calls, key=lambda c: c[1])
    assert (result.params, result.score, result.output) == best
    expected = selection_report(BOUND, expected_trials=4, delta=DELTA)
    assert result.report == expected and result.epsilon == expected["epsilon"]
    # one trial alone is what each engine reports; the release costs more
    assert result.per_trial_epsilon == pytest.approx(history_epsilon(BOUND, DELTA), rel=1e-12)
    assert result.per_trial_epsilon < expected["per_trial_epsilon_rdp"] < result.epsilon
    assert "the selection included" in result.summary() and "one trial alone" in result.summary()
    assert set(vars(result)) == {"output", "score", "params", "report"}  # no other trial, no K


def test_the_per_trial_epsilon_is_what_a_trial_reports():
    outcome = private_trial(0.1)
    assert history_epsilon(BOUND, DELTA) == pytest.approx(outcome.privacy.get_epsilon(DELTA), rel=1e-12)


def test_a_trial_above_the_declared_bound_is_refused():
    with pytest.raises(ValueError, match="spends more privacy than the per-trial bound"):
        tune(lambda: private_trial(0.1, epochs=2), per_trial=BOUND, expected_trials=3, shape=1, delta=DELTA,
             secure=False, seed=0)
    with pytest.raises(ValueError, match="spends more privacy than the per-trial bound"):
        tune(lambda: private_trial(0.1, noise_multiplier=0.8), per_trial=BOUND, expected_trials=3, shape=1,
             delta=DELTA, secure=False, seed=0)


def test_a_trial_without_noise_or_without_its_privacy_is_refused():
    with pytest.raises(ValueError, match="without noise"), pytest.warns(UserWarning, match="not differentially private"):
        tune(lambda: private_trial(0.1, noise_multiplier=0.0), per_trial=BOUND, expected_trials=2, shape=1,
             delta=DELTA, secure=False, seed=0)
    with pytest.raises(ValueError, match="privacy is required"):
        tune(lambda: TrialOutcome(output=None, score=1.0), per_trial=BOUND, expected_trials=2, shape=1,
             delta=DELTA, secure=False, seed=0)


def test_poisson_may_draw_no_trial_and_then_releases_nothing():
    seed = next(s for s in range(1000) if draw_trial_count(1, POISSON, secure=False, seed=s) == 0)
    result = tune(lambda: pytest.fail("no trial may run"), per_trial=BOUND, expected_trials=1, delta=DELTA,
                  secure=False, seed=seed)
    assert (result.output, result.score) == (None, None) and math.isfinite(result.epsilon)


def test_the_trial_count_is_drawn_from_the_csprng_unless_replay_is_asked_for(monkeypatch):
    drawn = []
    monkeypatch.setattr("dptorch.tuning.secure_uniforms", lambda count: drawn.append(count) or [0.99])
    assert draw_trial_count(10, 1) == trial_count(10, 1, 0.99) and drawn == [1]
    with pytest.raises(ValueError, match="replayable"):
        draw_trial_count(10, 1, seed=5)
    assert draw_trial_count(10, 1, secure=False, seed=5) == draw_trial_count(10, 1, secure=False, seed=5)


def test_scores_that_are_not_numbers_never_win_and_maximize_picks_the_largest():
    scores = iter([math.nan, 3.0, 5.0, 1.0] * 50)
    rng = random.Random(0)

    def run():
        return TrialOutcome(output=rng.random(), score=next(scores), privacy=BOUND)

    k = draw_trial_count(6, 1, secure=False, seed=11)
    assert k >= 4
    result = tune(run, per_trial=BOUND, expected_trials=6, shape=1, delta=DELTA, maximize=True, secure=False, seed=11)
    assert result.score == 5.0


def test_a_plain_report_says_the_selection_is_not_accounted():
    line = tuning_summary({"per_trial_epsilon": 2.0, "delta": DELTA, "selection_accounted": False})
    assert "per trial" in line and SELECTION_NOT_ACCOUNTED in line


def test_the_worked_example_of_the_docs():
    """docs/choosing-hyperparameters.md: trials like the example's run (q = 0.064, 48 steps) at epsilon 4 release
    the best of a logarithmic K of mean 20 at 7.728; trials at target_epsilon=4.1 release within 8."""
    def release(per_trial_target):
        sigma = get_noise_multiplier(target_epsilon=per_trial_target, target_delta=1e-5, sample_rate=0.064, steps=48)
        return selection_report([(sigma, 0.064, 48)], expected_trials=20, shape=0, delta=1e-5)["epsilon"]

    assert round(release(4.0), 3) == 7.728
    assert 7.9 < release(4.1) <= 8.0
