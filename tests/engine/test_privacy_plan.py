"""One privacy plan: the sampler's rate and steps, the noise and clipping, the accountant; the
optimizer, the loader, calibration, the report and the checkpoints all read the same object."""

import io
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import DPDataLoader, PrivacyEngine
from dptorch.accounting import create_accountant
from dptorch.plan import PrivacyPlan, planned_steps


def make(n=60, batch=12, seed=0, loader=None):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3))
    data = TensorDataset(torch.randn(n, 4), torch.randint(0, 3, (n,)))
    engine = PrivacyEngine()
    _hooks, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(data) if loader else DataLoader(data, batch_size=batch),
        noise_multiplier=1.2, max_grad_norm=0.7, wrap_model=False,
    )
    return engine, model, opt, dl


def step(model, opt, dl):
    x, y = next(iter(dl))
    opt.zero_grad()
    if len(y):
        nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_engine_optimizer_and_loader_read_one_plan():
    engine, model, opt, dl = make()
    plan = engine.plan
    assert opt.plan is plan and dl.privacy_plan is plan and plan.accountant is engine.accountant
    sampler = dl.batch_sampler
    assert (plan.sample_rate, plan.steps_per_epoch, plan.num_units) == (sampler.sample_rate, len(dl), 60)
    assert opt.expected_batch_size == plan.expected_batch_size == pytest.approx(12)
    assert opt.noise_std == pytest.approx(1.2 * 0.7) and engine.sample_rate == plan.sample_rate
    step(model, opt, dl)
    opt.noise_multiplier = 2.0  # a schedule changes the plan: the accountant records what was added
    step(model, opt, dl)
    assert engine.accountant.history == [[1.2, 0.2, 1], [2.0, 0.2, 1]]
    report = engine.privacy_report(1e-5)
    assert report["noise_multiplier"] == 2.0 and report["steps"] == 2 and report["mechanism"] == "gaussian"
    assert report["epsilon"] == engine.get_epsilon(1e-5) == plan.epsilon(1e-5) > 0


def test_checkpoints_carry_the_plan_and_refuse_another_sampling(tmp_path):
    engine, model, opt, dl = make()
    for _ in range(3):
        step(model, opt, dl)
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path, module=model, optimizer=opt, data_loader=dl)
    assert torch.load(path, weights_only=True)["dptorch"]["plan"]["steps"] == 3
    resumed, rmodel, ropt, rdl = make(seed=1)
    resumed.load_checkpoint(path, module=rmodel, optimizer=ropt, data_loader=rdl)
    assert resumed.plan.steps == 3 and resumed.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    assert rdl.batch_sampler.position == 3
    other, omodel, oopt, odl = make(seed=1, loader=lambda data: DPDataLoader(data, sample_rate=0.25, seed=0))
    weights = [p.clone() for p in omodel.parameters()]
    with pytest.raises(ValueError, match="privacy plan has sample_rate=0.2, this run has 0.25"):
        other.load_checkpoint(path, module=omodel, optimizer=oopt, data_loader=odl)
    assert all(torch.equal(a, b) for a, b in zip(weights, omodel.parameters())) and other.plan.steps == 0


def test_plan_accounts_reports_and_round_trips_on_its_own():
    plan = PrivacyPlan(noise_multiplier=1.0, max_grad_norm=[0.3, 0.4], clipping="per_layer", sample_rate=0.01,
                       num_units=1000, steps_per_epoch=100, accountant="rdp")
    assert plan.sensitivity == pytest.approx(0.5) and plan.expected_batch_size == pytest.approx(10)
    assert plan.epsilon(1e-5) == 0.0
    plan.record_steps(50)
    expected = create_accountant("rdp")
    expected.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=50)
    assert plan.epsilon(1e-5) == expected.get_epsilon(1e-5)
    assert plan.epsilon_after(50, 1e-5) > plan.epsilon(1e-5)
    buffer = io.BytesIO()
    torch.save(plan.state_dict(), buffer)
    buffer.seek(0)
    copy = PrivacyPlan(noise_multiplier=1.0, sample_rate=0.01, num_units=1000, steps_per_epoch=100, accountant="rdp")
    copy.load_state_dict(torch.load(buffer, weights_only=True))
    assert copy.steps == 50 and copy.epsilon(1e-5) == plan.epsilon(1e-5)
    plan.noise_multiplier = 0.0
    plan.record_steps(1)
    assert plan.epsilon(1e-5) == math.inf and not plan.private and plan.steps == 51
    with pytest.raises(ValueError, match="mechanism"):
        PrivacyPlan(noise_multiplier=1.0, mechanism="banded")
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        PrivacyPlan(noise_multiplier=-1.0)


def test_calibrated_plan_meets_its_target_over_its_planned_steps():
    assert planned_steps(12, epochs=3) == 36 and planned_steps(12, steps=5) == 5
    assert planned_steps(10, epochs=0.25) == 3
    plan = PrivacyPlan.calibrated(target_epsilon=1.5, target_delta=1e-5, epochs=3, sample_rate=0.05,
                                  steps_per_epoch=20, num_units=500, max_grad_norm=1.0)
    assert plan.planned_steps == 60
    plan.record_steps(60)
    assert 0.99 * 1.5 <= plan.epsilon(1e-5) <= 1.5
    report = plan.report(1e-5)
    assert report["target_epsilon"] == 1.5 and report["planned_steps"] == 60
