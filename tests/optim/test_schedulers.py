"""Noise and clipping-bound schedules: values, step-by-step accounting, exact resume, refusals."""

import io
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.optim.schedulers import (
    ExponentialGradClip,
    ExponentialNoise,
    LambdaGradClip,
    LambdaNoise,
    StepGradClip,
    StepNoise,
)

N, D, BATCH = 64, 6, 16


def private(seed=0, data=None, **kwargs):
    torch.manual_seed(seed)
    data = data or TensorDataset(torch.randn(N, D), torch.randn(N, 1))
    model = nn.Linear(D, 1)
    engine = PrivacyEngine()
    options = dict(noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True, loss_reduction="sum")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=BATCH), **{**options, **kwargs},
    )
    return engine, model, optimizer, loader


def train_epoch(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        ((model(x) - y) ** 2).sum().backward()
        optimizer.step()


@pytest.mark.parametrize("make, expected", [
    (lambda o: ExponentialNoise(o, gamma=0.5), [1.0, 0.5, 0.25, 0.125]),
    (lambda o: StepNoise(o, step_size=2, gamma=0.5), [1.0, 1.0, 0.5, 0.5]),
    (lambda o: LambdaNoise(o, noise_lambda=lambda epoch: 1 + epoch), [1.0, 2.0, 3.0, 4.0]),
])
def test_noise_schedules_write_opacus_values_to_the_optimizer(make, expected):
    _, _, optimizer, _ = private()
    scheduler = make(optimizer)
    seen = [optimizer.noise_multiplier]
    for _ in expected[1:]:
        scheduler.step()
        seen.append(optimizer.noise_multiplier)
    assert seen == expected
    assert optimizer.noise_std == expected[-1] * optimizer.max_grad_norm


@pytest.mark.parametrize("make, expected", [
    (lambda o: ExponentialGradClip(o, gamma=2.0), [1.0, 2.0, 4.0]),
    (lambda o: StepGradClip(o, step_size=2, gamma=0.5), [1.0, 1.0, 0.5]),
    (lambda o: LambdaGradClip(o, scheduler_function=lambda epoch: 1 / (1 + epoch)), [1.0, 0.5, 1 / 3]),
])
def test_clipping_schedules_move_the_bound_and_the_noise_with_it(make, expected):
    _, _, optimizer, _ = private()
    scheduler = make(optimizer)
    for value in expected[1:]:
        scheduler.step()
        assert optimizer.max_grad_norm == value
        assert optimizer.noise_std == pytest.approx(value * optimizer.noise_multiplier, rel=1e-15)


def test_each_step_is_accounted_at_the_noise_multiplier_it_used():
    engine, model, optimizer, loader = private()
    scheduler = ExponentialNoise(optimizer, gamma=1.5)
    used = []
    for _ in range(3):
        steps_before = len(engine.accountant)
        train_epoch(model, optimizer, loader)
        used.append((optimizer.noise_multiplier, len(engine.accountant) - steps_before))
        scheduler.step()
    assert [sigma for sigma, _ in used] == [1.0, 1.5, 2.25]
    reference = type(engine.accountant)()  # PLD, the engine's default
    for sigma, steps in used:
        reference.step(noise_multiplier=sigma, sample_rate=BATCH / N, num_steps=steps)
    assert engine.get_epsilon(1e-5) == reference.get_epsilon(1e-5)
    constant = type(engine.accountant)()
    constant.step(noise_multiplier=1.0, sample_rate=BATCH / N, num_steps=sum(steps for _, steps in used))
    assert engine.get_epsilon(1e-5) < constant.get_epsilon(1e-5)  # the larger sigmas were counted as such


def test_the_drawn_noise_has_the_scheduled_std():
    torch.manual_seed(0)
    model = nn.Linear(400, 100, bias=False)  # 40 000 noise values
    data = TensorDataset(torch.zeros(N, 400), torch.zeros(N, 100))  # every per-sample gradient is zero
    _, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=1.0, max_grad_norm=0.5, loss_reduction="sum",
    )
    ExponentialNoise(optimizer, gamma=3.0).step()  # sigma 3, noise std 1.5
    x, y = next(iter(loader))
    ((model(x) - y) ** 2).sum().backward()
    optimizer.step()
    # the std of 40 000 draws is within 1% of the true one with probability > 1 - 1e-8 (its sd is 0.35%)
    assert float(model.weight.grad.std()) == pytest.approx(1.5, rel=0.02)


def test_a_lambda_reaching_zero_takes_unprotected_steps_and_epsilon_is_infinite():
    engine, model, optimizer, loader = private()
    scheduler = LambdaNoise(optimizer, noise_lambda=lambda epoch: 1.0 - epoch)
    train_epoch(model, optimizer, loader)
    assert math.isfinite(engine.get_epsilon(1e-5))
    scheduler.step()
    assert optimizer.noise_multiplier == 0.0
    train_epoch(model, optimizer, loader)
    assert engine.get_epsilon(1e-5) == math.inf


@pytest.mark.parametrize("make", [
    lambda o: ExponentialNoise(o, gamma=0.7),
    lambda o: LambdaNoise(o, noise_lambda=lambda epoch: 0.9 ** epoch),
    lambda o: StepGradClip(o, step_size=1, gamma=0.5),
])
def test_a_resumed_run_continues_the_schedule_and_its_accounting_exactly(make):
    engine, model, optimizer, loader = private(seed=1)
    scheduler = make(optimizer)
    for _ in range(2):
        train_epoch(model, optimizer, loader)
        scheduler.step()
    kind = "noise_scheduler" if "Noise" in type(scheduler).__name__ else "grad_clip_scheduler"
    buffer = io.BytesIO()
    engine.save_checkpoint(buffer, module=model, optimizer=optimizer, **{kind: scheduler})
    at_save = (optimizer.noise_multiplier, optimizer.max_grad_norm, scheduler.last_epoch)
    assert at_save[:2] != (1.0, 1.0)  # the schedule moved a value away from the one a fresh run starts at
    history_at_save = engine.accountant.history
    for _ in range(2):
        train_epoch(model, optimizer, loader)
        scheduler.step()

    resumed_engine, resumed_model, resumed_optimizer, resumed_loader = private(seed=1)
    resumed = make(resumed_optimizer)
    buffer.seek(0)
    resumed_engine.load_checkpoint(buffer, module=resumed_model, optimizer=resumed_optimizer, **{kind: resumed})
    assert (resumed_optimizer.noise_multiplier, resumed_optimizer.max_grad_norm, resumed.last_epoch) == at_save
    assert resumed_engine.accountant.history == history_at_save
    for _ in range(2):
        train_epoch(resumed_model, resumed_optimizer, resumed_loader)
        resumed.step()
    assert resumed_engine.accountant.history == engine.accountant.history  # N / batch steps per epoch, each sigma
    assert resumed_engine.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    assert (resumed_optimizer.noise_multiplier, resumed_optimizer.max_grad_norm) == (
        optimizer.noise_multiplier, optimizer.max_grad_norm)


def test_the_state_dict_is_plain_values_without_the_optimizer_or_the_function():
    _, _, optimizer, _ = private()
    scheduler = LambdaNoise(optimizer, noise_lambda=lambda epoch: 2.0)
    scheduler.step()
    state = scheduler.state_dict()
    assert state == {"base": 1.0, "last_epoch": 1}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


def test_a_noise_schedule_on_a_calibrated_run_is_refused():
    torch.manual_seed(0)
    model = nn.Linear(D, 1)
    _, optimizer, _ = PrivacyEngine().make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(N, D), torch.randn(N, 1)), batch_size=BATCH),
        target_epsilon=3.0, target_delta=1e-3, epochs=2, max_grad_norm=1.0,
    )
    sigma = optimizer.noise_multiplier
    with pytest.raises(ValueError, match="calibrated to target_epsilon=3.0.*make_private\\(noise_multiplier"):
        ExponentialNoise(optimizer, gamma=0.9)
    assert optimizer.noise_multiplier == sigma


def test_a_noise_schedule_under_bandmf_is_refused():
    _, _, optimizer, _ = private(noise_mechanism="bandmf", bands=2)
    with pytest.raises(ValueError, match="bandmf"):
        StepNoise(optimizer, step_size=1, gamma=0.5)
    assert optimizer.noise_multiplier == 1.0


@pytest.mark.parametrize("clipping, bound", [("adaptive", 1.0), ("automatic", 1.0), ("per_layer", [1.0, 1.0])])
def test_a_clipping_schedule_needs_flat_clipping(clipping, bound):
    _, _, optimizer, _ = private(clipping=clipping, max_grad_norm=bound)
    with pytest.raises(ValueError, match="needs flat clipping"):
        ExponentialGradClip(optimizer, gamma=0.5)


def test_the_bound_cannot_change_while_clipped_gradients_are_held():
    _, model, optimizer, loader = private()
    x, y = next(iter(loader))
    ((model(x) - y) ** 2).sum().backward()
    with pytest.raises(ValueError, match="clipped at the old bound"):
        optimizer.max_grad_norm = 0.5
    assert optimizer.max_grad_norm == 1.0
    optimizer.step()
    optimizer.max_grad_norm = 0.5
    assert optimizer.max_grad_norm == 0.5
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        optimizer.max_grad_norm = -1.0


def test_the_scheduled_bound_is_the_one_the_next_step_clips_at():
    torch.manual_seed(0)
    same = TensorDataset(100 * torch.ones(N, D), torch.zeros(N, 1))  # every gradient the same, far above the bound
    _, model, optimizer, loader = private(data=same, noise_multiplier=0.0)
    ExponentialGradClip(optimizer, gamma=0.25).step()  # bound 0.25
    x, y = next(iter(loader))
    ((model(x) - y) ** 2).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    update = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
    # the clipped sum of len(x) equal gradients clipped at 0.25 (clip margin 1e-6), times lr 0.1
    assert float(update.norm()) == pytest.approx(0.1 * 0.25 * len(x), rel=1e-4)


def test_a_scheduler_needs_the_dp_optimizer():
    with pytest.raises(TypeError, match="DPOptimizer"):
        ExponentialNoise(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), gamma=0.5)
