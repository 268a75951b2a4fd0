"""DPOptimizer: clipping bounds, noise, accumulation, delegation and state."""

import copy

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.noise import NoiseGenerator
from dptorch.optim import DPOptimizer


def model_and_data(n=6, scale=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(n, 5)
    if scale is not None:
        x = x * torch.as_tensor(scale).view(-1, 1)
    y = torch.randn(n, 3)
    return model, x, y


def private(model, *, lr=1.0, noise=0.0, C=1.0, reduction="sum", batch=None, clipping="flat", generator=None, inner=None):
    hooks = GradSampleHooks(model, loss_reduction=reduction)
    inner = inner or torch.optim.SGD(model.parameters(), lr=lr)
    opt = DPOptimizer(
        inner, hooks=hooks, noise_multiplier=noise, max_grad_norm=C, expected_batch_size=batch,
        loss_reduction=reduction, clipping=clipping, noise_generator=generator or NoiseGenerator(seed=0),
    )
    return hooks, opt


def loss_of(model, x, y, reduction="sum"):
    per_sample = ((model(x) - y) ** 2).sum(1)
    return per_sample.sum() if reduction == "sum" else per_sample.mean()


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_each_sample_contribution_is_clipped_flat(scale):
    model, x, y = model_and_data(n=4, scale=[scale] * 4)
    hooks, opt = private(model, C=0.5)
    for i in range(4):
        before = flat_params(model)
        loss_of(model, x[i : i + 1], y[i : i + 1]).backward()
        raw_norm = torch.cat([hooks.grad_samples[p][0].flatten() for p in model.parameters()]).norm()
        opt.step()
        opt.zero_grad()
        change = (flat_params(model) - before).norm()
        assert change <= 0.5 + 1e-5
        torch.testing.assert_close(change, torch.minimum(raw_norm, torch.tensor(0.5)), rtol=1e-4, atol=1e-6)
    hooks.cleanup()


def test_each_sample_contribution_is_clipped_per_layer():
    model, x, y = model_and_data(n=3, scale=[1e-3, 1.0, 1e3])
    thresholds = [0.1, 0.2, 0.3, 0.4]
    hooks, opt = private(model, C=thresholds, clipping="per_layer")
    for i in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        loss_of(model, x[i : i + 1], y[i : i + 1]).backward()
        raw = [hooks.grad_samples[p][0].norm() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        for p, b, c, r in zip(model.parameters(), before, thresholds, raw):
            change = (p.detach() - b).norm()
            assert change <= c + 1e-5
            torch.testing.assert_close(change, torch.minimum(r, torch.tensor(c)), rtol=1e-4, atol=1e-6)
    assert opt.noise_std == 0.0
    hooks.cleanup()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_huge_threshold_and_no_noise_equals_plain_step(reduction):
    model, x, y = model_and_data()
    plain = copy.deepcopy(model)
    hooks, opt = private(model, lr=0.1, C=1e9, reduction=reduction, batch=len(x))
    loss_of(model, x, y, reduction).backward()
    opt.step()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    loss_of(plain, x, y, reduction).backward()
    plain_opt.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q)
    hooks.cleanup()


class CountingGenerator(NoiseGenerator):
    def __init__(self):
        super().__init__(seed=0)
        self.calls, self.dtypes, self.numels = 0, [], []

    def noise_like(self, reference, std):
        self.calls += 1
        self.dtypes.append(reference.dtype)
        self.numels.append(reference.numel())
        return super().noise_like(reference, std)


def test_noise_drawn_once_per_logical_step_with_virtual_steps():
    model, x, y = model_and_data(n=6)
    gen = CountingGenerator()
    hooks, opt = private(model, noise=1.0, generator=gen, reduction="mean", batch=6)
    for chunk, last in ((slice(0, 2), False), (slice(2, 4), False), (slice(4, 6), True)):
        loss_of(model, x[chunk], y[chunk], "mean").backward()
        opt.signal_skip_step(do_skip=not last)
        opt.step()
        opt.zero_grad()
    assert gen.calls == 1  # one draw covering every parameter, once per logical step
    assert gen.numels == [sum(p.numel() for p in model.parameters())]
    hooks.cleanup()


def test_noise_std_is_noise_multiplier_times_clip():
    torch.manual_seed(0)
    model = nn.Linear(1000, 1000, bias=False)
    hooks, opt = private(model, noise=1.3, C=0.7, reduction="sum")
    before = model.weight.detach().clone()
    model(torch.zeros(2, 1000)).sum().backward()  # zero gradient: the update is pure noise
    opt.step()
    noise = model.weight.detach() - before
    assert noise.numel() >= 10**6
    assert abs(noise.std().item() / (1.3 * 0.7) - 1) < 0.02
    assert abs(noise.mean().item()) < 0.01
    hooks.cleanup()


def test_split_batches_accumulate_to_the_full_batch_step():
    """Clipping is per sample, so accumulating over backward passes equals one big batch."""
    model, x, y = model_and_data(n=6, scale=[0.1, 10, 1, 5, 0.5, 2])
    twin = copy.deepcopy(model)
    hooks, opt = private(model, lr=0.5, C=0.3, reduction="mean", batch=6)
    loss_of(model, x, y, "mean").backward()
    opt.step()
    hooks.cleanup()
    hooks2, opt2 = private(twin, lr=0.5, C=0.3, reduction="mean", batch=6)
    for chunk in (slice(0, 1), slice(1, 4), slice(4, 6)):
        loss_of(twin, x[chunk], y[chunk], "mean").backward()
        twin.zero_grad()  # the HF Trainer clears with model.zero_grad(); the accumulator survives
    opt2.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    hooks2.cleanup()


def test_model_zero_grad_instead_of_optimizer_zero_grad():
    model, x, y = model_and_data()
    hooks, opt = private(model, lr=0.1, noise=0.5, reduction="mean", batch=6)
    for _ in range(3):
        loss_of(model, x, y, "mean").backward()
        opt.step()
        model.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    hooks.cleanup()


def test_bf16_parameters_get_fp32_noise():
    model, x, y = model_and_data()
    model = model.to(torch.bfloat16)
    gen = CountingGenerator()
    hooks, opt = private(model, noise=1.0, generator=gen, reduction="mean", batch=6)
    loss_of(model, x.bfloat16(), y.bfloat16(), "mean").backward()
    opt.step()
    assert set(gen.dtypes) == {torch.float32}
    assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    hooks.cleanup()


def test_delegation_lr_scheduler_and_adam():
    model, x, y = model_and_data()
    hooks, opt = private(model, noise=0.1, reduction="mean", batch=6, inner=torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    assert opt.param_groups is opt.original_optimizer.param_groups
    for _ in range(2):
        loss_of(model, x, y, "mean").backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    assert len(opt.state) == 4
    hooks.cleanup()


def test_state_dict_round_trip_keeps_accumulator_and_noise_stream():
    model, x, y = model_and_data()
    hooks, opt = private(model, noise=1.0, reduction="mean", batch=6)
    loss_of(model, x[:3], y[:3], "mean").backward()
    opt.signal_skip_step(True)
    opt.step()
    opt.zero_grad()
    state = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    # continue the original
    loss_of(model, x[3:], y[3:], "mean").backward()
    opt.step()
    # restore into a fresh optimizer on the twin and continue identically
    hooks2, opt2 = private(twin, noise=1.0, reduction="mean", batch=6, generator=NoiseGenerator(seed=99))
    opt2.load_state_dict(state)
    loss_of(twin, x[3:], y[3:], "mean").backward()
    opt2.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    hooks.cleanup()
    hooks2.cleanup()


def test_closure_is_supported():
    model, x, y = model_and_data()
    hooks, opt = private(model, reduction="mean", batch=6)

    def closure():
        opt.zero_grad()
        loss = loss_of(model, x, y, "mean")
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    hooks.cleanup()


def test_bad_arguments_are_clear():
    model, _, _ = model_and_data()
    hooks = GradSampleHooks(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="expected logical batch size"):
        DPOptimizer(sgd, hooks=hooks, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=None)
    with pytest.raises(ValueError, match="clipping"):
        DPOptimizer(sgd, hooks=hooks, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, clipping="auto")
    with pytest.raises(ValueError, match="per_layer"):
        DPOptimizer(sgd, hooks=hooks, noise_multiplier=1.0, max_grad_norm=[1.0, 2.0], expected_batch_size=4)
    hooks.cleanup()


def test_a_training_backward_in_eval_mode_is_refused():
    from dptorch.grad_sample import PerSampleGradientError

    model, x, y = model_and_data()
    hooks, opt = private(model, reduction="mean", batch=6)
    model.eval()
    with pytest.raises(PerSampleGradientError, match=r"eval mode.*model.train\(\)"):
        loss_of(model, x, y, "mean").backward()
    hooks.cleanup()
