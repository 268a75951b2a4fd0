"""Small norm-layer calls of one configuration are sampled as one call, each taking its own rows."""

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.layers.registry import find_grad_sampler
from dptorch.grad_sample.modes.layer_call import LayerCall
from dptorch.grad_sample.modes.stacked_calls import merged, stack_key
from tests.helpers import check_per_sample_grads, projection_loss


class Blocks(nn.Module):
    """Norm layers repeating one configuration, one of another eps, one of another width, and a Linear."""

    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(6) for _ in range(4)] + [nn.LayerNorm(6, eps=1e-2)])
        self.rms = nn.ModuleList([nn.RMSNorm(6) for _ in range(3)])
        self.proj = nn.Linear(6, 9)
        self.wide = nn.LayerNorm(9)
        for p in self.parameters():  # not the identity: each layer's gradient its own
            nn.init.normal_(p)

    def forward(self, x):
        for norm in (*self.norms, *self.rms):
            x = torch.tanh(norm(x)) + x
        return self.wide(self.proj(x))


def test_stacked_norms_equal_each_sample_alone():
    torch.manual_seed(0)
    check_per_sample_grads(Blocks(), (torch.randn(5, 3, 6),), grad_sample_mode="hooks", loss_reduction="sum")


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_stacked_equal_sampled_alone(monkeypatch, mode):
    """The same per-sample gradients, norms and clipped sums as with every call sampled on its own."""
    import dptorch.grad_sample.modes.stacked_calls as stacked_calls

    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(5, 3, 6)
    factors = torch.rand(5)

    def run():
        hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
        projection_loss(model(x)).sum().backward()
        result = (hooks.grad_samples, hooks.per_sample_norms(), hooks.clipped_sums({p: factors for p in model.parameters()}))
        hooks.cleanup()
        return result

    import dptorch.grad_sample.modes.instantiate as instantiate

    runs = []
    monkeypatch.setattr(instantiate, "merged", lambda run: runs.append(len(run)) or merged(run))
    together = run()
    assert sorted(runs) == [3, 4]  # the four LayerNorms of one eps, the three RMSNorms
    monkeypatch.setattr(stacked_calls, "STACK_LIMIT", 0)
    alone = run()
    assert sorted(runs) == [3, 4]  # nothing more was merged
    for got, want in zip(together, alone):
        assert got.keys() == want.keys()
        for p in want:
            torch.testing.assert_close(got[p], want[p], rtol=1e-6, atol=1e-6)


def _call(module, x, b, sampler=None):
    sampler = find_grad_sampler(module) if sampler is None else sampler
    return LayerCall("norm", module, dict(module.named_parameters()), sampler, None, (x,), b)


def test_only_one_configuration_stacks():
    x, b = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    base = stack_key(_call(nn.LayerNorm(6), x, b))
    assert base is not None and base == stack_key(_call(nn.LayerNorm(6), x, b))
    assert stack_key(_call(nn.LayerNorm(6, eps=1e-2), x, b)) != base  # another eps
    assert stack_key(_call(nn.LayerNorm(6), x, b.double())) != base  # another dtype
    assert stack_key(_call(nn.LayerNorm(6), x[:1], b[:1])) != base  # another batch
    assert stack_key(_call(nn.LayerNorm(6), x[:0], b[:0])) is None  # an empty batch goes alone
    conv = nn.Conv1d(3, 3, 1)  # its sampler reads the weight's data: never stacked
    assert stack_key(_call(conv, torch.randn(2, 3, 4), torch.randn(2, 3, 4))) is None
    own = lambda module, activations, backprops: {}  # noqa: E731  (a user's sampler, even for a LayerNorm)
    assert stack_key(_call(nn.LayerNorm(6), x, b, own)) is None
    run = [_call(nn.LayerNorm(6), x, b), _call(nn.LayerNorm(6), x + 1, b - 1)]
    joined = merged(run)
    assert joined.module is run[0].module
    assert torch.equal(joined.activations[0], torch.cat([x, x + 1])) and torch.equal(joined.backprops, torch.cat([b, b - 1]))


class Conv1DBlocks(nn.Module):
    """transformers' Conv1D (GPT-2's projections) repeated: one configuration, four weights of their own."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.projs = nn.ModuleList([Conv1D(6, 6) for _ in range(4)])
        for p in self.parameters():
            nn.init.normal_(p)

    def forward(self, x):
        for proj in self.projs:
            x = torch.tanh(proj(x)) + x
        return x


def test_conv1d_calls_stack_exactly(monkeypatch):
    """HF Conv1D's rules are the Linear ones (no parameter data read): its calls stack in hooks mode, with the
    per-sample gradients of every call sampled alone and of each sample run alone."""
    import dptorch.grad_sample.modes.stacked_calls as stacked_calls
    import dptorch.grad_sample.modes.instantiate as instantiate

    torch.manual_seed(0)
    model, x = Conv1DBlocks(), torch.randn(5, 3, 6)
    check_per_sample_grads(model, (x,), grad_sample_mode="hooks", loss_reduction="sum")

    def grad_samples():
        hooks = GradSampleHooks(model, grad_sample_mode="hooks", loss_reduction="sum")
        projection_loss(model(x)).sum().backward()
        result = hooks.grad_samples
        hooks.cleanup()
        return result

    runs = []
    monkeypatch.setattr(instantiate, "merged", lambda run: runs.append(len(run)) or merged(run))
    together = grad_samples()
    assert runs == [4]
    monkeypatch.setattr(stacked_calls, "STACK_LIMIT", 0)
    alone = grad_samples()
    assert runs == [4] and together.keys() == alone.keys() and len(alone) == 8
    for p in alone:
        torch.testing.assert_close(together[p], alone[p], rtol=1e-6, atol=1e-6)


class WeightScaled(nn.Linear):
    """A Linear subclass whose registered grad sampler reads the weight's data."""


def _weight_scaled_grads(module, activations, backprops):
    scale = module.weight.detach().sum()
    return {module.weight: torch.einsum("bto,bti->boi", backprops, activations[0]) * scale,
            module.bias: backprops.sum(1) * scale}


def test_a_users_sampler_is_never_stacked(monkeypatch):
    """A sampler registered by the user may read its module's weights, so one module's call cannot stand for
    another's: each call is sampled by its own module, even for a subclass of a stackable layer."""
    import dptorch.grad_sample.modes.instantiate as instantiate
    from dptorch.grad_sample import register_grad_sampler

    register_grad_sampler(WeightScaled)(_weight_scaled_grads)
    torch.manual_seed(0)
    model, x = nn.Sequential(WeightScaled(4, 4), WeightScaled(4, 4)), torch.randn(3, 2, 4)
    runs = []
    monkeypatch.setattr(instantiate, "merged", lambda run: runs.append(len(run)) or merged(run))
    hooks = GradSampleHooks(model, grad_sample_mode="hooks", loss_reduction="sum")
    model(x).sum().backward()
    assert runs == []
    ones = torch.ones(3, 2, 4)  # the output gradient of the sum; the first layer's, through the second's weight
    for layer, inputs, backprops in ((model[0], x, ones @ model[1].weight.detach()), (model[1], model[0](x).detach(), ones)):
        want = _weight_scaled_grads(layer, (inputs,), backprops)
        for p in (layer.weight, layer.bias):
            torch.testing.assert_close(hooks.grad_samples[p], want[p], rtol=1e-6, atol=1e-6)
    hooks.cleanup()
