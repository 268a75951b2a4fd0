"""Pausing capture (Opacus' disable_hooks / enable_hooks / hooks_enabled), fail-closed.

A paused pass captures nothing; its raw gradients never reach a DP step (the step writes the clipped sums of
captured passes plus noise, and refuses a step with only paused passes behind it); resuming is exact.
"""

import pytest
import torch
from torch import nn

from dptorch import DPOptimizer
from dptorch.grad_sample import GradSampleHooks, GradSampleModule, PerSampleGradientError
from dptorch.noise import NoiseGenerator
from tests.helpers import projection_loss

MODES = ("hooks", "functorch", "bk", "ghost", "ew")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(seed: int = 1, n: int = 6) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def reference_norms(model: nn.Module, x: torch.Tensor):
    """Each parameter's gradient norm for each sample alone (a batch of one)."""
    rows = {p: [] for p in model.parameters()}
    for i in range(len(x)):
        model.zero_grad()
        projection_loss(model(x[i:i + 1])).sum().backward()
        for p in rows:
            rows[p].append(p.grad.norm())
    model.zero_grad()
    return {p: torch.stack(r) for p, r in rows.items()}


def dp_optimizer(model: nn.Module, hooks: GradSampleHooks) -> DPOptimizer:
    return DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=1.0,
                       max_grad_norm=0.5, expected_batch_size=6, noise_generator=NoiseGenerator(seed=3))


@pytest.mark.parametrize("mode", MODES)
def test_paused_pass_captures_nothing_and_resuming_is_exact(mode):
    model, x = mlp(), batch()
    want = reference_norms(model, x)
    hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=mode)
    assert hooks.hooks_enabled
    hooks.disable_hooks()
    assert not hooks.hooks_enabled
    projection_loss(model(batch(seed=2))).sum().backward()
    assert hooks.batch_size == 0 and not hooks.per_sample_norms() and not hooks.grad_samples
    assert not any("grad_sample" in p.__dict__ for p in model.parameters())
    assert set(hooks.paused_gradients) == set(model.parameters())  # p.grad holds them, unclipped
    model.zero_grad()
    hooks.forget_paused_gradients()
    hooks.enable_hooks()
    assert hooks.hooks_enabled
    projection_loss(model(x)).sum().backward()
    got = hooks.per_sample_norms()
    assert set(got) == set(want)
    for p, norms in want.items():
        torch.testing.assert_close(got[p], norms, rtol=1e-5, atol=1e-7)
    assert not hooks.paused_gradients
    hooks.cleanup()


@pytest.mark.parametrize("mode", MODES)
def test_step_after_only_paused_passes_is_refused_and_changes_nothing(mode):
    model = mlp()
    hooks = GradSampleHooks(model, grad_sample_mode=mode)
    optimizer = dp_optimizer(model, hooks)
    before = [p.detach().clone() for p in model.parameters()]
    hooks.disable_hooks()
    projection_loss(model(batch())).mean().backward()
    with pytest.raises(PerSampleGradientError, match="capture paused"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    optimizer.zero_grad()  # drops them: a step from here is an ordinary (empty) one
    assert not hooks.paused_gradients
    hooks.cleanup()


def _step_grads(mode: str, paused_pass: str):
    """p.grad written by one DP step over a captured pass, with a paused pass of another batch before or after
    it (``paused_pass``: "before", "after", "none")."""
    model = mlp()
    hooks = GradSampleHooks(model, grad_sample_mode=mode)
    optimizer = dp_optimizer(model, hooks)

    def paused():
        hooks.disable_hooks()
        (100 * projection_loss(model(batch(seed=5))).mean()).backward()  # large, unclipped: must not show
        hooks.enable_hooks()

    if paused_pass == "before":
        paused()
    projection_loss(model(batch())).mean().backward()
    if paused_pass == "after":
        paused()
    optimizer.step()
    grads = [p.grad.clone() for p in model.parameters()]
    hooks.cleanup()
    return grads


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("paused_pass", ["before", "after"])
def test_paused_pass_gradients_never_reach_the_step(mode, paused_pass):
    want = _step_grads(mode, "none")
    got = _step_grads(mode, paused_pass)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_opacus_second_backward_with_hooks_disabled_is_refused_and_the_first_steps():
    """Opacus' fast-clipping idiom, a paused second backward through the captured forward: refused (dptorch
    clips in the first backward); the first pass's step is the one-pass step."""
    want = _step_grads("ghost", "none")
    model = mlp()
    hooks = GradSampleHooks(model, grad_sample_mode="ghost")
    optimizer = dp_optimizer(model, hooks)
    losses = projection_loss(model(batch()))
    losses.mean().backward(retain_graph=True)
    hooks.disable_hooks()
    with pytest.raises(PerSampleGradientError, match="disable_hooks.*not needed"):
        (7 * losses).sum().backward()
    hooks.enable_hooks()
    optimizer.step()
    for p, w in zip(model.parameters(), want):
        assert torch.equal(p.grad, w)
    hooks.cleanup()


def test_paused_forward_with_capture_resumed_for_its_backward_is_refused():
    model = mlp()
    hooks = GradSampleHooks(model, loss_reduction="sum")
    hooks.disable_hooks()
    out = model(batch())
    hooks.enable_hooks()
    with pytest.raises(PerSampleGradientError, match="no per-sample gradient"):
        projection_loss(out).sum().backward()
    hooks.cleanup()


def test_pausing_inside_a_forward_is_refused():
    class Toggle(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x):
            hooks.disable_hooks()
            return self.linear(x)

    model = Toggle()
    hooks = GradSampleHooks(model)
    with pytest.raises(RuntimeError, match="between passes"):
        model(batch())
    assert hooks.hooks_enabled
    hooks.cleanup()


def test_wrapper_pauses_its_controller():
    model = mlp()
    wrapped = GradSampleModule(model, loss_reduction="sum")
    wrapped.disable_hooks()
    assert not wrapped.hooks_enabled and not wrapped.hooks.hooks_enabled
    projection_loss(wrapped(batch())).sum().backward()
    assert not wrapped.grad_samples
    model.zero_grad()
    wrapped.enable_hooks()
    projection_loss(wrapped(batch())).sum().backward()
    assert wrapped.hooks_enabled and set(wrapped.grad_samples) == set(model.parameters())
    assert wrapped.to_standard_module() is model and not wrapped.hooks_enabled
