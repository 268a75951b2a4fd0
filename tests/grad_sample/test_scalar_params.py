"""Parameters of any rank, 0-d included (a learnable temperature, CLIP's ``logit_scale``).

In every mode the per-sample gradients (hooks, functorch), the per-sample norms and the clipped
sum equal the batch-of-one reference, whether the 0-d parameter is held by the root (the torch.func
fallback replays its forward), by a layer with its own grad and norm samplers, or by a module
without a sampler; expanded weights refuse the module clearly; a 0-d parameter read outside any
forward is refused, before any parameter changes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks, register_grad_sampler
from dptorch.grad_sample.errors import PerSampleGradientError, UnsupportedModuleError
from dptorch.grad_sample.layers.registry import register_norm_sampler
from dptorch.optim import DPOptimizer
from dptorch.clipping.factors import clip_factors, flat_norms
from tests.helpers import projection_loss, reference_per_sample_grads, single_thread  # noqa: F401  (autouse fixture)

MODES = ["hooks", "bk", "ghost", "functorch"]
C = 0.3


class TemperatureRoot(nn.Module):
    """``logits * t`` in the root's own forward, plus a rank-3 parameter: the root has direct parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.t = nn.Parameter(torch.tensor(1.5))
        self.cube = nn.Parameter(torch.randn(2, 1, 3) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.t + self.cube.prod(0).squeeze(0) * x[:, :3]


class Temperature(nn.Module):
    """``x * t`` with a 0-d ``t``: a layer with a registered grad sampler and norm sampler."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.t


@register_grad_sampler(Temperature)
def _temperature_grad_sampler(module, activations, backprops):
    x = activations[0]
    return {module.t: (x * backprops).reshape(x.shape[0], -1).sum(1)}


def _temperature_clipped_sum(module, activations, scaled_backprops):
    return {module.t: (activations[0] * scaled_backprops).sum()}


@register_norm_sampler(Temperature, clipped_sum=_temperature_clipped_sum)
def _temperature_norms(module, activations, backprops):
    return {module.t: _temperature_grad_sampler(module, activations, backprops)[module.t].pow(2)}


class ScaledBlock(nn.Module):
    """A module without a sampler holding a 0-d parameter beside a child layer (torch.func fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.logit_scale = nn.Parameter(torch.tensor(0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.logit_scale.exp()


def layered() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), Temperature(), nn.Tanh(), ScaledBlock(), Temperature())


MODELS = {"root": TemperatureRoot, "layered": layered}


def inputs(n: int = 5) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(n))


def captured(model, mode, x):
    """Per-sample gradients held, per-sample norms and the clipped sum at C, from one backward pass."""
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum", keep_param_grads=False)
    try:
        projection_loss(model(x)).sum().backward()
        norms = hooks.per_sample_norms()
        factor = clip_factors(flat_norms(norms), C)
        sums = hooks.clipped_sums({p: factor for p in norms})
        return dict(hooks.grad_samples), norms, sums
    finally:
        hooks.cleanup()
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_gradients_norms_and_clipped_sum_equal_batch_of_one(name, mode):
    torch.manual_seed(0)
    model = MODELS[name]()
    x = inputs()
    want = {p: g.double() for p, g in reference_per_sample_grads(copy.deepcopy(model), (x,), projection_loss).items()}
    want = dict(zip(model.parameters(), want.values()))  # keyed by this model's parameters
    grads, norms, sums = captured(model, mode, x)
    names = {p: n for n, p in model.named_parameters()}
    assert any(p.dim() == 0 for p in want)
    assert set(norms) == set(want)
    for p, g in want.items():
        torch.testing.assert_close(norms[p].double(), g.reshape(len(x), -1).norm(dim=1), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{names[p]} norms: {m}")
        if p in grads:  # instantiated (hooks, functorch; bk/ghost: the layers without a norm sampler)
            assert grads[p].shape == g.shape
            torch.testing.assert_close(grads[p].double(), g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{names[p]}: {m}")
    total = torch.stack([g.reshape(len(x), -1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
    factor = clip_factors(total, C).double()
    for p, g in want.items():
        assert sums[p].shape == p.shape
        torch.testing.assert_close(sums[p].double(), torch.einsum("i,i...->...", factor, g), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{names[p]} clipped sum: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_a_dp_step_updates_a_0d_parameter(mode):
    torch.manual_seed(0)
    model = TemperatureRoot()
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0, max_grad_norm=C,
                      loss_reduction="sum")
    before = model.t.detach().clone()
    projection_loss(model(inputs())).sum().backward()
    opt.step()
    hooks.cleanup()
    assert model.t.shape == () and model.t.grad.shape == ()
    assert model.t.item() != before.item()


def test_expanded_weights_refuse_a_module_holding_a_0d_parameter():
    with pytest.raises(UnsupportedModuleError, match=r"<root> \(TemperatureRoot\).*grad_sample_mode='hooks'"):
        GradSampleHooks(TemperatureRoot(), grad_sample_mode="ew", loss_reduction="sum")
    with pytest.raises(UnsupportedModuleError, match=r"Temperature"):
        GradSampleHooks(layered(), grad_sample_mode="ew", loss_reduction="sum")


class ReadOutside(nn.Module):
    """A 0-d parameter the forward never reads: the loss multiplies by it (a path the controller does not see)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.logit_scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("mode", MODES)
def test_a_0d_parameter_read_outside_any_forward_is_refused_before_anything_changes(mode):
    torch.manual_seed(0)
    model = ReadOutside()
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0, max_grad_norm=C,
                      loss_reduction="sum")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PerSampleGradientError, match="logit_scale"):
        (projection_loss(model(inputs())) * model.logit_scale).sum().backward()
        opt.step()
    hooks.cleanup()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
