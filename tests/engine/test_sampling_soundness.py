"""The epsilon the engine reports is never below the truth: each step is one fresh Poisson draw of
exactly the samples the backward passes saw, calibration uses the accounted rate and steps, secure
mode covers the sampling, and settings the optimizer would reject are refused up front."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import BatchMemoryManager, DPDataLoader, PrivacyEngine
from dptorch.accounting import create_accountant
from dptorch.grad_sample import PerSampleGradientError
from dptorch.plan import SamplingMismatchError
from tests.helpers import snapshot


def setup(n=200, batch=20, features=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, 6), nn.ReLU(), nn.Linear(6, 2))
    data = TensorDataset(torch.randn(n, features), torch.randint(0, 2, (n,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=batch)


def private(engine=None, **options):
    model, opt, dl = setup()
    engine = engine or PrivacyEngine()
    settings = dict(noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False, loss_reduction="sum")  # backward()'s sum
    settings.update(options)
    _hooks, opt, dl = engine.make_private(module=model, optimizer=opt, data_loader=dl, **settings)
    return engine, model, opt, dl


def backward(model, batch):
    x, y = batch
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def accounted_epsilon(sigma, q, steps, delta=1e-5):
    accountant = create_accountant("pld")
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_epsilon(delta)


# --- 1: fresh draws --------------------------------------------------------------------------


def test_a_loop_of_new_iterators_trains_on_fresh_batches_and_accounts_each():
    engine, model, opt, dl = private()
    seen = set()
    for _ in range(20):
        x, y = next(iter(dl))  # a new iterator for every step
        seen.add(tuple(x[:, 0].tolist()))
        opt.zero_grad()
        if len(y):
            backward(model, (x, y))
        opt.step()
    assert len(seen) == 20  # was 1: every step replayed the first batch of epoch 0
    assert engine.plan.steps == len(engine.accountant) == 20
    # What was at stake: the same batch 20 times is one draw of 20 Gaussian queries, i.e. one step
    # with noise sigma/sqrt(20), far above the 20 independent steps the accountant records.
    replayed = accounted_epsilon(1.0 / math.sqrt(20), 0.1, 1)
    assert replayed > 5 * engine.get_epsilon(1e-5)


# --- 2: one draw per step, every draw accounted ----------------------------------------------


def test_manual_accumulation_over_several_draws_is_refused_before_anything_changes():
    engine, model, opt, dl = private()
    batches = iter(dl)
    opt.zero_grad()
    for _ in range(3):
        backward(model, next(batches))  # three Poisson draws summed under one noise draw
    before_params, before_grads = params(model), grads(model)
    with pytest.raises(SamplingMismatchError, match=r"3 batches drawn .* BatchMemoryManager"):
        opt.step()
    assert same(params(model), before_params) and same(grads(model), before_grads)
    assert len(engine.accountant) == 0
    # the same with the virtual-step API across draws
    opt.zero_grad()
    for _ in range(2):
        backward(model, next(batches))
        opt.signal_skip_step(True)
        opt.step()
    backward(model, next(batches))
    with pytest.raises(SamplingMismatchError, match="3 batches drawn"):
        opt.step()
    assert same(params(model), before_params) and len(engine.accountant) == 0


def test_physical_batches_of_one_draw_keep_working_by_hand_and_with_the_memory_manager():
    engine, model, opt, dl = private()
    x, y = next(iter(dl))
    for chunk, last in ((slice(0, 5), False), (slice(5, None), True)):
        backward(model, (x[chunk], y[chunk]))
        opt.signal_skip_step(not last)
        opt.step()
        opt.zero_grad()
    assert len(engine.accountant) == 1
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=3, optimizer=opt) as physical:
        for batch in physical:
            opt.zero_grad()
            if len(batch[1]):
                backward(model, batch)
            opt.step()
    assert len(engine.accountant) == len(dl)  # the memory manager completed epoch 0: 9 more draws


def test_a_draw_that_fed_no_step_is_accounted_at_the_next_step():
    engine, model, opt, dl = private()
    peeked = next(iter(dl))  # drawn, never stepped on
    assert len(peeked[1]) > 0
    batch = next(iter(dl))
    opt.zero_grad()
    backward(model, batch)
    opt.step()
    assert len(engine.accountant) == engine.plan.steps == 2
    assert engine.get_epsilon(1e-5) == pytest.approx(accounted_epsilon(1.0, 0.1, 2))


def test_gradients_dropped_by_zero_grad_do_not_count_as_accumulation():
    engine, model, opt, dl = private()
    batches = iter(dl)
    backward(model, next(batches))
    opt.zero_grad()  # drops the first draw's gradients: it is accounted, not refused
    backward(model, next(batches))
    opt.step()
    assert len(engine.accountant) == 2


# --- 3: the samples the backward passes saw are the draw's -----------------------------------


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 2)

    def forward(self, x):
        return self.proj(x)


def sequence_run(batch_first, transpose=False, units=False):
    torch.manual_seed(0)
    model = Sequence()
    data = TensorDataset(torch.randn(60, 3, 4))  # batch-first: (N, T=3, features)
    engine = PrivacyEngine()
    _hooks, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=12),
        noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False, batch_first=batch_first, loss_reduction="sum",
    )
    (x,) = next(iter(dl))
    assert len(x) not in (0, 3)
    if transpose:
        x = x.transpose(0, 1)
    if units:
        engine.hooks.set_privacy_units(torch.arange(x.shape[1]) // 2)
    model(x).pow(2).sum().backward()
    return engine, model, opt


@pytest.mark.parametrize("units", [False, True])
def test_batch_first_data_with_batch_first_false_is_refused_naming_batch_first(units):
    """Time steps taken as samples: the draw's watch knows the loader's samples are along dim 0, so the
    forward is refused (with privacy units over the time steps too: a drawn sample would be in every unit)."""
    with pytest.raises(PerSampleGradientError, match=r"rows along dim 0.*check batch_first"):
        sequence_run(batch_first=False, units=units)


def test_batch_first_false_data_the_loader_did_not_draw_is_refused_at_the_step():
    """Without the draw's watch (a tensor the loader did not hand out), the draw ledger refuses the step."""
    torch.manual_seed(0)
    model = Sequence()
    engine = PrivacyEngine()
    _hooks, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(60, 3, 4)), batch_size=12),
        noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False, batch_first=False, loss_reduction="sum")
    (x,) = next(iter(dl))
    model(torch.from_numpy(x.numpy().copy())).pow(2).sum().backward()  # a copy through numpy: not followed
    before = params(model)
    with pytest.raises(SamplingMismatchError, match=r"saw 3 samples, but the DP data loader drew \d+ .*batch_first=True"):
        opt.step()
    assert same(params(model), before) and len(engine.accountant) == 0


def test_matching_layouts_pass():
    for kwargs in (dict(batch_first=True), dict(batch_first=False, transpose=True)):
        engine, model, opt = sequence_run(**kwargs)
        opt.step()
        assert len(engine.accountant) == 1, kwargs


def test_data_that_did_not_come_from_the_loader_is_refused_before_anything_changes():
    """Was accounted as a Poisson step of q = 0.1 (tests/engine/test_draw_soundness.py covers the other forms)."""
    engine, model, opt, dl = private()
    before = params(model)
    backward(model, (torch.randn(7, 4), torch.randint(0, 2, (7,))))
    with pytest.raises(SamplingMismatchError, match="7 samples that no Poisson draw"):
        opt.step()
    assert same(params(model), before) and len(engine.accountant) == 0


# --- 4: calibration uses the accounted rate and steps ----------------------------------------


def test_make_private_with_epsilon_calibrates_at_the_samplers_rate_and_steps():
    model, opt, dl = setup(n=100)
    loader = DPDataLoader(dl.dataset, sample_rate=0.2, steps=10, seed=1)  # 10 draws of q=0.2 per pass
    engine = PrivacyEngine()
    _hooks, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=opt, data_loader=loader, target_epsilon=2.0, target_delta=1e-5, epochs=2,
        max_grad_norm=1.0, wrap_model=False, loss_reduction="sum",
    )
    assert engine.plan.planned_steps == 20 and engine.sample_rate == 0.2
    for _ in range(2):
        for batch in loader:
            opt.zero_grad()
            if len(batch[1]):
                backward(model, batch)
            opt.step()
    assert len(engine.accountant) == 20
    epsilon = engine.get_epsilon(1e-5)
    assert 1.98 <= epsilon <= 2.0  # was 3.17: calibrated at q = 1/len(loader) = 0.1
    assert epsilon == pytest.approx(accounted_epsilon(opt.noise_multiplier, 0.2, 20))


# --- 5: secure mode covers the sampling ------------------------------------------------------


def draws_after_seeding(secure_mode):
    torch.manual_seed(0)
    _, _, _, dl = private(PrivacyEngine(secure_mode=secure_mode))
    return [tuple(next(iter(dl))[0][:, 0].tolist()) for _ in range(3)]


def test_secure_mode_sampling_is_not_reproducible_from_torch_seed():
    assert draws_after_seeding(False) == draws_after_seeding(False)
    assert draws_after_seeding(True) != draws_after_seeding(True)
    model, opt, dl = setup()
    seeded = DPDataLoader(dl.dataset, sample_rate=0.1, seed=3)
    with pytest.raises(ValueError, match=r"secure_mode=True needs the Poisson sampling .* secure_mode=True"):
        PrivacyEngine(secure_mode=True).make_private(module=model, optimizer=opt, data_loader=seeded,
                                                     noise_multiplier=1.0, max_grad_norm=1.0)


# --- 7: noise_multiplier = 0 -----------------------------------------------------------------


def test_zero_noise_is_a_warned_clipping_only_run_with_infinite_epsilon():
    with pytest.warns(UserWarning, match="not differentially private"):
        engine, model, opt, dl = private(noise_multiplier=0.0)
    before = params(model)
    for batch in (next(iter(dl)) for _ in range(2)):
        opt.zero_grad()
        backward(model, batch)
        opt.step()
    assert not same(params(model), before)
    assert engine.get_epsilon(1e-5) == math.inf
    report = engine.privacy_report(1e-5)
    assert report["epsilon"] == math.inf and report["private"] is False and "no differential privacy" in report["note"]
    assert report["steps"] == 2


# --- 8: per-layer thresholds are checked at make_private -------------------------------------


def test_a_per_layer_list_of_the_wrong_length_is_refused_before_anything_is_attached():
    model, opt, dl = setup()
    before = snapshot(model)
    engine = PrivacyEngine()
    with pytest.raises(ValueError, match=r"one max_grad_norm per trainable parameter .* got 3 thresholds for 4 parameters \(0.weight, 0.bias, 2.weight, 2.bias\)"):
        engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0,
                            max_grad_norm=[1.0, 1.0, 1.0], clipping="per_layer", wrap_model=False)
    assert snapshot(model) == before and engine.hooks is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0,
                            max_grad_norm=[1.0] * 4, clipping="per_layer", wrap_model=False)
    assert engine.hooks.attached
