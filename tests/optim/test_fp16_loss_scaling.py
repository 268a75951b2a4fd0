"""fp16 with loss scaling, privately: ``DPGradScaler`` under CPU float16 autocast.

The plain recipe (``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``) with a
``DPGradScaler`` must give the float32 step up to float16 rounding; a unit whose scaled gradient
overflows float16 contributes zero, the step is still taken and the other units are exact; the
scale never depends on the data; torch's own GradScaler is refused before anything is stepped.

The error bound: float16's unit roundoff is ``u = 2^-11``. Each per-sample gradient entry of the
3-layer net below is an output gradient times an activation, each rounded to float16 once per op
it passed through (input and weight casts, each matmul and tanh output, forward and backward:
about ten roundings); independent roundings add in quadrature, about ``sqrt(10) u = 3.2 u`` on
the clipped sum. The bound is ``4 u``; measured worst: ``1.49 u`` (hooks), ``1.45 u`` (bk and
ghost) over 10 seeds and clipping bounds 0.05 (every unit clipped) and 100 (none). A clipping done
on scaled norms, or a clipped sum left scaled, is off by a factor up to 256 here.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch.engine import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks
from dptorch.noise import NoiseGenerator
from dptorch.optim import DPGradScaler, DPOptimizer, NonFiniteGradientWarning
from dptorch.optim.loss_scaling import loss_scale_at
from tests.helpers import single_thread  # noqa: F401  (autouse fixture)

U16 = 2.0**-11  # float16 unit roundoff
BOUND = 4 * U16
MODES = ["hooks", "bk", "ghost"]
N, OVERFLOW_UNIT, SCALE = 8, 3, 2.0**8


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(seed: int = 0):
    torch.manual_seed(100 + seed)
    return torch.randn(N, 8), torch.randn(N, 4)


def private_step(model, x, t, *, mode="bk", fp16=True, max_grad_norm=1.0, sigma=0.0, noise_seed=0, scaler_cls=DPGradScaler):
    """One private SGD step (lr 1) of a copy of ``model`` on ``(x, t)``; returns the flat gradient it applied.

    The loss is a sum over units and the expected batch size is always N, so a batch without one unit gives
    every other unit the same float16 backward values and the step the divisor of the full batch."""
    model = copy.deepcopy(model)
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=sigma,
                            max_grad_norm=max_grad_norm, expected_batch_size=N, noise_generator=NoiseGenerator(seed=noise_seed))
    scaler = DPGradScaler(optimizer, init_scale=SCALE) if fp16 else None
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), t, reduction="sum")
    if fp16:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # float32 master gradients
    applied = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters())])
    hooks.cleanup()
    return applied


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("max_grad_norm", [0.05, 100.0])
def test_fp16_step_matches_float32_within_fp16_rounding(mode, max_grad_norm):
    for seed in range(3):
        model, (x, t) = net(seed), batch(seed)
        fp16 = private_step(model, x, t, mode=mode, max_grad_norm=max_grad_norm)
        fp32 = private_step(model, x, t, mode=mode, fp16=False, max_grad_norm=max_grad_norm)
        assert relative(fp16, fp32) <= BOUND


def test_noise_is_float32_and_the_same_draw_as_in_float32():
    """The noise is drawn in float32 and added to the float32 clipped sum: the noised minus the noiseless step is
    the same in the fp16 and the float32 run to float32 rounding (a float16 noise would differ by ~2^-11)."""
    model, (x, t) = net(), batch()
    noise16 = private_step(model, x, t, sigma=1.0) - private_step(model, x, t)
    noise32 = private_step(model, x, t, fp16=False, sigma=1.0) - private_step(model, x, t, fp16=False)
    assert float((noise16 - noise32).abs().max()) <= 2.0**-20 * float(noise32.abs().max())
    assert float(noise32.std()) == pytest.approx(1.0 / N, rel=0.1)  # sigma C / B, over 1,000+ entries


@pytest.mark.parametrize("mode", MODES)
def test_overflowed_unit_contributes_zero_and_the_step_is_taken(mode):
    model, (x, t) = net(), batch()
    t[OVERFLOW_UNIT] = 3e4  # its output gradient 2 (y - t) times 2^8 is ~1.5e7 > 65504: inf in float16
    kept = [i for i in range(N) if i != OVERFLOW_UNIT]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16 = private_step(model, x, t, mode=mode)
    messages = [str(w.message) for w in caught if issubclass(w.category, NonFiniteGradientWarning)]
    assert len(messages) == 1 and "DPGradScaler init_scale" in messages[0]
    assert torch.isfinite(fp16).all() and fp16.abs().max() > 0  # the step was taken, nothing non-finite in it
    without16 = private_step(model, x[kept], t[kept], mode=mode)
    # equal up to float32 summation order (N - 1 terms summed with and without a zero): a few ulps of the
    # largest entry; a unit's clipped contribution would be ~1/N of it
    assert float((fp16 - without16).abs().max()) <= 2.0**-18 * float(without16.abs().max())
    without32 = private_step(model, x[kept], t[kept], mode=mode, fp16=False)
    assert relative(fp16, without32) <= BOUND
    # In float32 (no scale) the unit is finite and clipped to C: it does contribute there.
    assert relative(private_step(model, x, t, mode=mode, fp16=False), without32) > 100 * BOUND


def scaled_training(init_scale, growth_interval, max_scale, batches, *, overflow=False, virtual_every=0):
    """The plain recipe over ``batches`` physical batches (every ``virtual_every``-th one a virtual step; with
    ``overflow`` one unit of each batch overflows); returns the scale each batch saw, the optimizer steps called
    and the scaler."""
    model = net()
    hooks = GradSampleHooks(model, grad_sample_mode="bk")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=N)
    scaler = DPGradScaler(optimizer, init_scale=init_scale, growth_interval=growth_interval, max_scale=max_scale)
    seen, steps, original = [], [], optimizer.step
    optimizer.step = lambda *args, **kwargs: steps.append(1) or original(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        for physical in range(batches):
            x, t = batch(physical)
            if overflow:
                t[physical % N] = 1e6
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            seen.append(scaler.get_scale())
            scaler.scale(nn.functional.mse_loss(out.float(), t)).backward()
            if virtual_every and physical % virtual_every == 0:
                optimizer.signal_skip_step()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    hooks.cleanup()
    return seen, len(steps), scaler


def test_schedule_depends_on_the_step_count_only():
    """Overflowing data every step or none: the same scales, those of ``loss_scale_at``; no step skipped."""
    expected = [loss_scale_at(s, 2.0**4, 2.0, 2, 2.0**6) for s in range(6)]
    assert expected == [16.0, 16.0, 32.0, 32.0, 64.0, 64.0]
    clean, overflowing = (scaled_training(2.0**4, 2, 2.0**6, 6, overflow=o)[:2] for o in (False, True))
    assert clean == overflowing == (expected, 6)


def test_virtual_steps_share_the_scale_of_their_logical_step():
    """Two physical batches per logical step (signal_skip_step): the scale advances once per real step."""
    seen, _, _ = scaled_training(2.0**4, 1, 2.0**10, 6, virtual_every=2)
    assert seen == [16.0, 16.0, 32.0, 32.0, 64.0, 64.0]


def test_schedule_function():
    assert [loss_scale_at(s, 2.0**10) for s in (0, 10**6)] == [2.0**10, 2.0**10]
    assert loss_scale_at(10**9, 2.0**10, 2.0, 1) == 2.0**24  # capped by default
    assert loss_scale_at(5, 2.0**10, 4.0, 2, 2.0**13) == 2.0**13
    assert loss_scale_at(3, 2.0**10, 4.0, 2, 2.0**20) == 2.0**12


def engine_run(scaler_factory, overflow: bool):
    model = net()
    x, t = torch.randn(64, 8), torch.randn(64, 4)
    if overflow:
        t[5] = 1e6
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        data_loader=DataLoader(TensorDataset(x, t), batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0,
    )
    torch.manual_seed(3)
    scaler = scaler_factory(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        for xb, tb in loader:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(xb)
            scaler.scale(nn.functional.mse_loss(out.float(), tb)).backward()
            scaler.step(optimizer)
            scaler.update()
    return engine, model, before, loader


def test_engine_plain_recipe_every_draw_is_one_accounted_step():
    for overflow in (False, True):
        engine, model, before, loader = engine_run(lambda opt: DPGradScaler(opt, init_scale=2.0**8), overflow)
        assert engine.accountant.history[-1][-1] == len(loader)  # one step per draw, none skipped
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.filterwarnings("ignore::dptorch.optim.NonFiniteGradientWarning")
def test_torch_grad_scaler_is_refused_before_anything_changes():
    with pytest.raises(RuntimeError, match=r"DPGradScaler\(optimizer") as refused:
        engine_run(lambda opt: torch.amp.GradScaler("cpu"), False)
    assert "Nothing was stepped or accounted" in str(refused.value)
    model = net()
    hooks = GradSampleHooks(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=N)
    before = copy.deepcopy(model.state_dict())
    scaler = torch.amp.GradScaler("cpu")
    x, t = batch()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    scaler.scale(nn.functional.mse_loss(out.float(), t)).backward()
    with pytest.raises(RuntimeError, match="torch.amp.GradScaler drove this DPOptimizer step"):
        scaler.step(optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")


def test_bad_settings_are_refused_with_the_fix():
    model = net()
    hooks = GradSampleHooks(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=N)
    with pytest.raises(ValueError, match="init_scale must be a power of two"):
        DPGradScaler(optimizer, init_scale=1000.0)
    with pytest.raises(ValueError, match="growth_factor must be a power of two"):
        DPGradScaler(optimizer, growth_factor=3.0, growth_interval=10)
    with pytest.raises(ValueError, match="max_scale must be a power of two >= init_scale"):
        DPGradScaler(optimizer, init_scale=2.0**10, max_scale=2.0**8)
    with pytest.raises(TypeError, match="Pass the optimizer make_private returned"):
        DPGradScaler(torch.optim.SGD(model.parameters(), lr=1.0))
    scaler = DPGradScaler(optimizer)
    with pytest.raises(ValueError, match="set init_scale, growth_interval"):
        scaler.update(new_scale=1024.0)
    half = net().half()
    half_hooks = GradSampleHooks(half)
    half_opt = DPOptimizer(torch.optim.SGD(half.parameters(), lr=1.0), hooks=half_hooks, noise_multiplier=0.0,
                           max_grad_norm=1.0, expected_batch_size=N)
    with pytest.raises(ValueError, match="Keep the parameters in float32"):
        DPGradScaler(half_opt)


def test_state_dict_carries_the_schedule_position():
    _, _, scaler = scaled_training(2.0**4, 1, 2.0**10, 3)
    state = scaler.state_dict()
    assert state["scale"] == 2.0**7 and state["dp_steps"] == 3
    resumed = DPGradScaler(scaler.optimizer, init_scale=2.0**4, growth_interval=1, max_scale=2.0**10)
    resumed.load_state_dict(state)
    assert resumed.get_scale() == resumed.current_scale == 2.0**7
    with pytest.raises(ValueError, match="not saved by a DPGradScaler"):
        resumed.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
