"""DP-BandMF: banded strategy, streaming noise, cyclic Poisson sampling, amplified accounting, API."""

import io
import math
import warnings

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch.accounting import get_noise_multiplier
from dptorch.data.cyclic_poisson import CyclicPoissonBatchSampler, CyclicPoissonDataLoader
from dptorch.data.poisson import DPDataLoader, PoissonBatchSampler
from dptorch.engine import PrivacyEngine
from dptorch.noise import NoiseGenerator
from dptorch.noise.banded import (
    BandedNoise,
    BandedToeplitz,
    banded_noise_matrix,
    optimal_banded_strategy,
    prefix_sum_error,
    reduction_event,
)
from dptorch.noise.banded.optimize import square_root_start
from dptorch.plan import PrivacyPlan, SamplingMismatchError

# ------------------------------------------------------------------ strategy


def test_inverse_coefficients_are_the_dense_inverse_and_error_is_the_dense_frobenius_norm():
    strategy = BandedToeplitz.normalise([1.0, 0.6, 0.3, 0.2])
    n = 40
    dense_inverse = torch.linalg.inv(strategy.matrix(n))
    assert torch.allclose(strategy.inverse_coefficients(n), dense_inverse[:, 0], atol=1e-12)
    prefix = torch.tril(torch.ones(n, n, dtype=torch.float64))
    assert float(prefix_sum_error(strategy.tensor(), n)) == pytest.approx(float((prefix @ dense_inverse).pow(2).sum()), rel=1e-10)
    norms = strategy.column_norms(n)
    assert torch.allclose(norms, torch.linalg.norm(strategy.matrix(n), dim=0))
    assert norms.max() == pytest.approx(1.0)


def test_optimised_band_is_normalised_and_beats_identity_and_closed_form_start():
    n, b = 200, 8
    strategy = optimal_banded_strategy(n, b)
    assert strategy.bands == b and strategy.normalised and strategy.norm == pytest.approx(1.0)
    error = float(prefix_sum_error(strategy.tensor(), n))
    start = square_root_start(b)
    assert error < float(prefix_sum_error(start / start.norm(), n))
    assert error < 0.5 * n * (n + 1) / 2  # DP-SGD (identity) has error n (n + 1) / 2
    assert optimal_banded_strategy(n, b) is not strategy and optimal_banded_strategy(n, b) == strategy  # cached band
    assert optimal_banded_strategy(n, 1).coefficients == (1.0,)


def test_unnormalised_strategy_is_refused():
    with pytest.raises(ValueError, match="norm"):
        PrivacyPlan(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.1, mechanism="bandmf",
                    strategy=BandedToeplitz([1.0, 0.5]))
    with pytest.raises(ValueError, match="norm"):
        BandedNoise(BandedToeplitz([1.0, 0.5]), NoiseGenerator(seed=0))


# ------------------------------------------------------------------ streaming noise


@pytest.mark.parametrize("bands", [1, 3, 6])
def test_streaming_noise_equals_dense_inverse_times_z(bands):
    n, shape, std = 15, (4, 3), 0.7
    strategy = optimal_banded_strategy(n, bands)
    streamed_source = BandedNoise(strategy, NoiseGenerator(seed=5))
    reference = torch.zeros(shape, dtype=torch.float64)
    streamed = torch.stack([streamed_source.noise_like(reference, std) for _ in range(n)])
    plain = NoiseGenerator(seed=5)
    z = torch.stack([plain.noise_like(reference, 1.0) for _ in range(n)])
    expected = std * banded_noise_matrix(strategy, z)
    assert torch.allclose(streamed, expected, atol=1e-10)
    if bands > 1:
        assert not torch.allclose(streamed, std * z)  # the noise is correlated, not the i.i.d. draws


def test_resumed_noise_state_continues_the_same_stream():
    strategy = optimal_banded_strategy(20, 4)
    reference = torch.zeros(9)
    straight = BandedNoise(strategy, NoiseGenerator(seed=1))
    first = [straight.noise_like(reference, 1.0) for _ in range(7)]
    saved = straight.state_dict()
    rest = [straight.noise_like(reference, 1.0) for _ in range(5)]
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    resumed = BandedNoise(strategy, NoiseGenerator(seed=99))
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(torch.equal(a, resumed.noise_like(reference, 1.0)) for a in rest)
    assert first  # (the first part is what the checkpoint captured)
    other = BandedNoise(optimal_banded_strategy(20, 3), NoiseGenerator(seed=1))
    with pytest.raises(ValueError, match="strategy"):
        other.load_state_dict(saved)


# ------------------------------------------------------------------ sampling


def test_cyclic_sampler_is_b_min_separated_and_partitions_the_data():
    bands, n = 3, 50
    sampler = CyclicPoissonBatchSampler(n, 0.6, bands=bands, seed=3)
    parts = [set(p.tolist()) for p in sampler.partitions]
    assert set().union(*parts) == set(range(n)) and sum(map(len, parts)) == n
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    last_seen = {}
    for _ in range(4):
        for position, batch in sampler.draws():
            for index in batch:
                assert index in parts[position % bands]
                if index in last_seen:
                    assert position - last_seen[index] >= bands
                last_seen[index] = position
    assert sampler.position == 4 * len(sampler) and len(sampler) % bands == 0
    assert len(last_seen) == n
    assert sampler.global_expected_batch_size == pytest.approx(0.6 * n / bands)


def test_one_band_cyclic_sampling_is_poisson_sampling():
    cyclic = CyclicPoissonBatchSampler(40, 0.2, bands=1, seed=11)
    poisson = PoissonBatchSampler(40, 0.2, seed=11)
    assert [b for _, b in cyclic.draws()] == [b for _, b in poisson.draws()]


def test_cyclic_sampler_state_resumes_position_and_partitions():
    sampler = CyclicPoissonBatchSampler(30, 0.2, bands=3, seed=2)
    iterator = iter(sampler)
    for _ in range(4):
        next(iterator)
    state = sampler.state_dict()
    expected = [next(iterator) for _ in range(5)]
    other = CyclicPoissonBatchSampler(30, 0.2, bands=3, seed=7)
    other.load_state_dict(state)
    resumed = iter(other)
    assert [next(resumed) for _ in range(5)] == expected
    with pytest.raises(ValueError, match="bands"):
        CyclicPoissonBatchSampler(30, 0.2, bands=2, seed=2).load_state_dict(state)


# ------------------------------------------------------------------ accounting


def _direct_epsilon(sigma, q, steps, bands, delta):
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(reduction_event(sigma, q, steps, bands))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("steps", [1, 9, 12])
def test_accounting_is_the_theorems_reduction(steps):
    sigma, q, bands, delta = 1.1, 0.3, 4, 1e-5
    plan = PrivacyPlan(noise_multiplier=sigma, max_grad_norm=1.0, sample_rate=q, mechanism="bandmf",
                       strategy=optimal_banded_strategy(12, bands))
    for _ in range(steps):
        plan.record_steps(1)
    assert plan.steps == steps
    assert len(plan.accountant) == math.ceil(steps / bands)
    assert plan.epsilon(delta) == pytest.approx(_direct_epsilon(sigma, q, steps, bands, delta), rel=5e-3)
    # the reduction is Poisson-sampled Gaussian composed ceil(steps / b) times, as the event says
    event = reduction_event(sigma, q, steps, bands)
    assert event.count == math.ceil(steps / bands)
    assert event.event == dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    assert plan.epsilon_after(3, delta) == pytest.approx(
        _direct_epsilon(sigma, q, steps + 3, bands, delta), rel=5e-3)


def test_steps_past_the_horizon_keep_accounting_and_warn_once():
    plan = PrivacyPlan(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.2, mechanism="bandmf",
                       strategy=optimal_banded_strategy(4, 2))
    plan.record_steps(4)
    with pytest.warns(UserWarning, match="optimised for"):
        plan.record_steps(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan.record_steps(2)
    assert len(plan.accountant) == math.ceil(7 / 2)


# ------------------------------------------------------------------ engine


def _data(n=120):
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator))


def _train(noise_mechanism, bands=None, steps=6, seed=0, engine_kwargs=None, epsilon=None, resume_at=None):
    torch.manual_seed(seed)
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine()
    common = dict(module=model, optimizer=optimizer, data_loader=DataLoader(_data(), batch_size=10),
                  max_grad_norm=1.0, noise_mechanism=noise_mechanism, bands=bands, **(engine_kwargs or {}))
    if epsilon is None:
        model, optimizer, loader = engine.make_private(noise_multiplier=1.3, **common)
    else:
        model, optimizer, loader = engine.make_private_with_epsilon(target_epsilon=epsilon, target_delta=1e-5,
                                                                    steps=steps, **common)
    taken = 0
    while taken < steps:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            taken += 1
            if taken == resume_at:  # between steps: the next batch is not drawn yet
                state = io.BytesIO()
                engine.save_checkpoint(state, module=model, optimizer=optimizer, data_loader=loader)
                return state
            if taken == steps:
                break
    return engine, model, optimizer, loader


def test_one_band_is_dp_sgd_exactly():
    sgd_engine, sgd_model, _, sgd_loader = _train("independent")
    mf_engine, mf_model, mf_optimizer, mf_loader = _train("bandmf", bands=1)
    assert isinstance(mf_optimizer.noise_generator, BandedNoise)
    for p, q in zip(sgd_model.parameters(), mf_model.parameters()):
        assert torch.equal(p, q)  # same batches, same noise, same updates
    assert mf_engine.get_epsilon(1e-5) == sgd_engine.get_epsilon(1e-5) > 0
    assert mf_engine.privacy_report(1e-5)["noise_mechanism"] == "bandmf"
    assert sgd_engine.privacy_report(1e-5)["noise_mechanism"] == "independent"


def test_engine_bandmf_uses_cyclic_sampling_and_the_reduction():
    engine, model, optimizer, loader = _train("bandmf", bands=3, steps=7)
    assert isinstance(loader, CyclicPoissonDataLoader) and loader.bands == 3
    q_p = loader.sample_rate
    assert q_p == pytest.approx(3 / 12)  # 12 batches of 10: the expected batch (10) is kept
    assert engine.plan.expected_batch_size == pytest.approx(10)
    report = engine.privacy_report(1e-5)
    assert report["bands"] == 3 and report["steps"] == 7 and report["accounted_steps"] == 3
    assert report["epsilon"] == pytest.approx(_direct_epsilon(1.3, q_p, 7, 3, 1e-5), rel=5e-3)


def test_calibrated_bandmf_noise_meets_the_target_via_the_reduction():
    engine, *_ = _train("bandmf", bands=2, steps=8, epsilon=4.0)
    q_p = engine.plan.sample_rate
    expected = get_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=q_p, steps=4)
    assert engine.noise_multiplier == pytest.approx(expected, rel=1e-9)
    assert engine.get_epsilon(1e-5) <= 4.0 + 1e-6
    assert engine.get_epsilon(1e-5) == pytest.approx(4.0, rel=2e-2)


def test_bandmf_refuses_uncovered_settings():
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    poisson = DPDataLoader(_data(), sample_rate=0.1)
    with pytest.raises(ValueError, match="b-min-separated"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=poisson, noise_multiplier=1.0,
                                     max_grad_norm=1.0, noise_mechanism="bandmf", bands=2)
    with pytest.raises(ValueError, match="partitions"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, max_grad_norm=1.0, noise_multiplier=1.0,
                                     data_loader=CyclicPoissonDataLoader(_data(), sample_rate=0.3, bands=3),
                                     noise_mechanism="bandmf", bands=2)
    with pytest.raises(ValueError, match="adaptive"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=DataLoader(_data(), batch_size=10),
                                     noise_multiplier=1.0, max_grad_norm=1.0, clipping="adaptive",
                                     noise_mechanism="bandmf", bands=2)
    with pytest.raises(ValueError, match="bands"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=DataLoader(_data(), batch_size=10),
                                     noise_multiplier=1.0, max_grad_norm=1.0, noise_mechanism="bandmf")


def test_a_draw_of_the_wrong_partition_is_refused():
    engine, model, optimizer, loader = _train("bandmf", bands=3, steps=2)
    loader.batch_sampler.draw()  # a draw no step accounts: the next one is of the wrong partition
    with pytest.raises(SamplingMismatchError, match="partition"):
        next(iter(loader))


def test_resume_mid_run_gives_the_same_noise_and_parameters():
    _, straight_model, straight_optimizer, _ = _train("bandmf", bands=3, steps=8)
    checkpoint = _train("bandmf", bands=3, steps=8, resume_at=5)
    checkpoint.seek(0)
    torch.manual_seed(123)  # a different start: everything must come from the checkpoint
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(_data(), batch_size=10), noise_multiplier=1.3,
        max_grad_norm=1.0, noise_mechanism="bandmf", bands=3)
    engine.load_checkpoint(checkpoint, module=model, optimizer=optimizer, data_loader=loader)
    assert optimizer.noise_generator.index == 5
    taken = 5
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        taken += 1
        if taken == 8:
            break
    for p, q in zip(straight_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert optimizer.noise_generator.index == straight_optimizer.noise_generator.index == 8


def test_a_bare_optimizer_with_a_bandmf_plan_adds_banded_noise():
    from dptorch.grad_sample import GradSampleHooks
    from dptorch.optim.optimizer import DPOptimizer

    model = nn.Linear(6, 3)
    plan = PrivacyPlan(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.1, expected_batch_size=4.0,
                       mechanism="bandmf", strategy=optimal_banded_strategy(10, 3))
    hooks = GradSampleHooks(model, loss_reduction="sum")  # the loss below is a sum
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, plan=plan,
                            noise_generator=NoiseGenerator(seed=0))
    assert isinstance(optimizer.noise_generator, BandedNoise)
    for _ in range(4):
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.noise_generator.index == 4 == plan.steps
    assert "bandmf" == optimizer.state_dict()["dp"]["noise_generator"]["mechanism"]
    hooks.cleanup()


def test_noise_multiplier_cannot_change_during_a_bandmf_run():
    engine, model, optimizer, loader = _train("bandmf", bands=2, steps=4)
    with pytest.raises(ValueError, match="cannot change"):
        engine.plan.noise_multiplier = engine.plan.noise_multiplier * 2


def test_calibrated_bandmf_divides_by_the_expected_batch_of_one_partition():
    # 120 samples, batches of 10: q_p = b / 12 and a step samples one of b partitions, 10 expected
    # samples; the noised sum must be divided by 10 (not q_p * N = b * 10, which would train at lr / b)
    for epsilon in (None, 4.0):
        engine, _, optimizer, loader = _train("bandmf", bands=3, steps=6, epsilon=epsilon)
        assert loader.batch_sampler.expected_batch_size == pytest.approx(10)
        assert engine.plan.expected_batch_size == pytest.approx(10)
        assert optimizer.expected_batch_size == pytest.approx(10)
