"""PrivacyEngine: one return shape, non-wrapping mode, checks before training, accounting."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import BatchMemoryManager, DPDataLoader, GradSampleModule, PrivacyEngine
from tests.helpers import snapshot


def setup(n=40, batch=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    data = TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=batch)


def train(model, optimizer, loader, steps=None):
    done = 0
    for x, y in loader:
        optimizer.zero_grad()
        if len(y):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        done += 1
        if steps and done == steps:
            break
    return done


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_non_wrapping_returns_the_same_model_and_detaches_without_trace(mode):
    model, opt, dl = setup()
    before = snapshot(model)
    engine = PrivacyEngine()
    hooks, dp_opt, dp_dl = engine.make_private(
        module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0,
        wrap_model=False, grad_sample_mode=mode,
    )
    assert hooks is engine.hooks and hooks.module is model and type(model) is nn.Sequential
    assert isinstance(dp_dl, DPDataLoader) and dp_dl.sample_rate == pytest.approx(1 / 5)
    assert hooks.attached
    train(model, dp_opt, dp_dl, steps=2)
    hooks.cleanup()
    assert snapshot(model) == before


def test_wrapping_returns_the_same_three_things():
    model, opt, dl = setup()
    engine = PrivacyEngine()
    wrapped, dp_opt, dp_dl = engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0)
    assert isinstance(wrapped, GradSampleModule) and wrapped._module is model
    assert train(wrapped, dp_opt, dp_dl, steps=3) == 3
    assert len(engine.accountant) == 3


def test_checks_before_training():
    model, opt, dl = setup()
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not in the model"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0)
    model.eval()
    with pytest.raises(ValueError, match="eval mode"):
        PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0)
    model.train()
    with pytest.raises(ValueError, match="sample rate"):
        PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=DataLoader(dl.dataset, batch_size=None), noise_multiplier=1.0, max_grad_norm=1.0)
    engine = PrivacyEngine()
    engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
    with pytest.raises(RuntimeError, match="detach"):
        engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)


def test_accountant_counts_every_logical_step_including_empty_batches():
    model, opt, dl = setup(n=40, batch=2)  # q = 1/20: empty batches are common
    engine = PrivacyEngine()
    hooks, dp_opt, dp_dl = engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
    sizes = []
    for x, y in dp_dl:
        sizes.append(len(y))
        dp_opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y) if len(y) else model(x).sum()  # an empty batch runs too
        loss.backward()
        dp_opt.step()
    assert 0 in sizes
    assert len(engine.accountant) == len(sizes) == 20
    eps_20 = engine.get_epsilon(1e-5)
    train(model, dp_opt, dp_dl)
    assert engine.get_epsilon(1e-5) > eps_20 > 0


def test_virtual_steps_with_batch_memory_manager_count_logical_steps():
    model, opt, dl = setup(n=64, batch=16)
    engine = PrivacyEngine()
    hooks, dp_opt, dp_dl = engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
    with BatchMemoryManager(data_loader=dp_dl, max_physical_batch_size=4, optimizer=dp_opt) as physical:
        physical_steps = train(model, dp_opt, physical)
    assert len(engine.accountant) == len(dp_dl) == 4
    assert physical_steps >= 4


def test_make_private_with_epsilon_meets_the_target():
    model, opt, dl = setup()
    engine = PrivacyEngine()
    hooks, dp_opt, dp_dl = engine.make_private_with_epsilon(
        module=model, optimizer=opt, data_loader=dl, target_epsilon=2.0, target_delta=1e-5, epochs=3,
        max_grad_norm=1.0, wrap_model=False,
    )
    for _ in range(3):
        train(model, dp_opt, dp_dl)
    eps = engine.get_epsilon(1e-5)
    assert len(engine.accountant) == 15
    assert 1.9 < eps <= 2.0


def test_privacy_report_for_a_model_card():
    model, opt, dl = setup()
    engine = PrivacyEngine(accountant="rdp")
    hooks, dp_opt, dp_dl = engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.1, max_grad_norm=0.5, wrap_model=False)
    train(model, dp_opt, dp_dl, steps=2)
    report = engine.privacy_report(1e-5)
    assert report["steps"] == 2 and report["accountant"] == "rdp" and report["noise_multiplier"] == 1.1
    assert report["sample_rate"] == pytest.approx(0.2) and report["sampling"] == "poisson" and report["clipping"] == "flat"
    assert math.isfinite(report["epsilon"]) and report["epsilon"] > 0


def one_private_step(mode):
    from dptorch import DPLoss
    from dptorch.noise import NoiseGenerator

    model, opt, dl = setup()
    engine = PrivacyEngine()
    hooks, dp_opt, dp_dl = engine.make_private(
        module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=0.5,
        wrap_model=False, grad_sample_mode=mode, noise_generator=NoiseGenerator(seed=5),
    )
    criterion = nn.CrossEntropyLoss()
    if mode == "ghost":
        criterion = DPLoss(criterion, engine.hooks)
    torch.manual_seed(1)
    x, y = next(iter(dp_dl))
    dp_opt.zero_grad()
    criterion(model(x), y).backward()
    dp_opt.step()
    engine.detach()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_every_mode_trains_with_the_same_loop_and_same_result():
    reference = one_private_step("hooks")
    for mode in ("functorch", "bk", "ghost"):
        torch.testing.assert_close(one_private_step(mode), reference, rtol=1e-5, atol=1e-6, msg=lambda m: f"{mode}: {m}")
