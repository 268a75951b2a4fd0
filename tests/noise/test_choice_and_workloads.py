"""DP-BandMF: the SGD workload (momentum, learning-rate schedule) and choosing the number of bands."""

import math

import pytest
import torch

from dptorch.accounting import get_noise_multiplier
from dptorch.noise.banded import (
    BandedToeplitz,
    SGDWorkload,
    choose_bands,
    optimal_banded_strategy,
    prefix_sum_error,
)

N = 48
COSINE = tuple(0.5 * (1 + math.cos(math.pi * t / N)) for t in range(N))


def _dense_error(workload, strategy, n):
    return float((workload.matrix(n) @ torch.linalg.inv(strategy.matrix(n))).pow(2).sum())


@pytest.mark.parametrize("workload", [SGDWorkload(), SGDWorkload(momentum=0.9), SGDWorkload(0.5, COSINE)])
def test_workload_error_is_the_dense_frobenius_norm(workload):
    for strategy in (BandedToeplitz.normalise([1.0, 0.7, 0.2, 0.4]), BandedToeplitz.identity()):
        expected = _dense_error(workload, strategy, N)
        assert float(workload.error(strategy.tensor(), N)) == pytest.approx(expected, rel=1e-10)


def test_workload_matrix_is_sgd_with_momentum_and_schedule():
    # theta_t = -sum_{s<=t} eta_s m_s, m_s = beta m_{s-1} + g_s: the response to a unit gradient at step r
    beta, n, r = 0.8, 7, 2
    rates = [1.0, 0.9, 0.8, 0.5, 0.4, 0.2, 0.1]
    momentum, total, path = 0.0, 0.0, []
    for s in range(n):
        momentum = beta * momentum + (1.0 if s == r else 0.0)
        total += rates[s] * momentum
        path.append(total)
    assert torch.allclose(SGDWorkload(beta, rates).matrix(n)[:, r], torch.tensor(path, dtype=torch.float64))


def test_prefix_workload_is_the_prefix_sum_error():
    c = optimal_banded_strategy(N, 3).tensor()
    assert float(SGDWorkload().error(c, N)) == pytest.approx(float(prefix_sum_error(c, N)), rel=1e-12)
    assert optimal_banded_strategy(N, 3, workload=SGDWorkload()) == optimal_banded_strategy(N, 3)


@pytest.mark.parametrize("workload", [SGDWorkload(momentum=0.9), SGDWorkload(momentum=0.9, learning_rates=COSINE)])
def test_strategy_optimised_for_sgd_beats_the_prefix_sum_one_on_that_workload(workload):
    for bands in (2, 4):
        tuned = optimal_banded_strategy(N, bands, workload=workload)
        prefix = optimal_banded_strategy(N, bands)
        assert tuned.normalised and tuned.norm == pytest.approx(1.0) and tuned.bands == bands
        assert tuned != prefix
        tuned_error = _dense_error(workload, tuned, N)
        assert tuned_error < 0.99 * _dense_error(workload, prefix, N)
        assert tuned_error < _dense_error(workload, BandedToeplitz.identity(), N)


def test_workload_refuses_bad_settings():
    with pytest.raises(ValueError, match="momentum"):
        SGDWorkload(momentum=1.0)
    with pytest.raises(ValueError, match="learning rates"):
        SGDWorkload(learning_rates=(1.0, 0.5)).error(torch.tensor([1.0], dtype=torch.float64), 3)


# ------------------------------------------------------------------ choosing b


def _relative_error(epsilon, n, q, bands):
    """sigma_b^2 ||A C_b^{-1}||_F^2 / (sigma_1^2 n (n + 1) / 2), with dense matrices."""
    def sigma(b):
        return get_noise_multiplier(target_epsilon=epsilon, target_delta=1e-5, sample_rate=b * q, steps=-(-n // b))
    banded = _dense_error(SGDWorkload(), optimal_banded_strategy(n, bands), n)
    return sigma(bands) ** 2 * banded / (sigma(1) ** 2 * n * (n + 1) / 2)


def test_choose_bands_falls_back_to_dp_sgd_where_banded_noise_cannot_win():
    # low epsilon: amplification dominates; sigma_b grows faster than the banded error falls
    choice = choose_bands(target_epsilon=0.5, target_delta=1e-5, steps=N, sample_rate=0.1, candidates=(2, 4))
    assert choice.bands == 1
    assert choice.relative_errors[1] == 1.0
    assert choice.relative_errors[2] > 1.0 and choice.relative_errors[4] > 1.0
    assert choice.relative_errors[2] == pytest.approx(_relative_error(0.5, N, 0.1, 2), rel=1e-6)


def test_choose_bands_picks_a_banded_strategy_where_its_error_is_lower():
    choice = choose_bands(target_epsilon=8.0, target_delta=1e-5, steps=N, sample_rate=0.1, candidates=(2, 4))
    assert choice.bands in (2, 4)
    assert choice.relative_errors[choice.bands] == min(choice.relative_errors.values()) < 1.0
    assert choice.relative_errors[4] == pytest.approx(_relative_error(8.0, N, 0.1, 4), rel=1e-6)
    assert choice.noise_multipliers[4] > choice.noise_multipliers[2] > choice.noise_multipliers[1]


def test_choose_bands_skips_candidates_the_data_cannot_serve():
    choice = choose_bands(target_epsilon=8.0, target_delta=1e-5, steps=N, sample_rate=0.3, candidates=(2, 3, 4, 6))
    assert set(choice.relative_errors) == {1, 2, 3}  # 4 x 0.3 > 1: no partition rate for b = 4, 6
    with pytest.raises(ValueError, match="sample_rate"):
        choose_bands(target_epsilon=8.0, target_delta=1e-5, steps=N, sample_rate=0.0)
