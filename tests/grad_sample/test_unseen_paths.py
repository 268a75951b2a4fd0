"""Every gradient a trainable parameter receives passes through the controller, once per step.

A weight read outside its module's call, a parameter unfrozen after attach and used in eval
mode, and a second backward pass through one forward are all refused before any parameter
changes; legitimate patterns (virtual steps over separate forwards, empty batches) still train.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError

MODES = ["hooks", "bk", "ghost", "functorch", "ew"]


class TiedHead(nn.Module):
    """A language-model head tied to the embedding, computed as ``h @ emb.weight.T``."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids)))
        return h @ self.emb.weight.T


def private(model, mode, data=None):
    data = data or DataLoader(TensorDataset(torch.randint(0, 11, (32, 5))), batch_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    _hooks, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=data, noise_multiplier=1.0, max_grad_norm=1.0,
        grad_sample_mode=mode, wrap_model=False, loss_reduction="sum",  # the tests' losses are sums
    )
    return model, optimizer, loader  # the model trains itself; the controller is also engine.hooks


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_unchanged(model, before):
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mode", MODES)
def test_weight_read_outside_its_module_is_refused(mode):
    torch.manual_seed(0)
    model, optimizer, _ = private(TiedHead(), mode)
    before = snapshot(model)
    ids = torch.randint(0, 11, (4, 5))
    # expanded weights refuse the direct read in forward themselves, with torch's own message
    expected = (PerSampleGradientError, RuntimeError) if mode == "ew" else PerSampleGradientError
    with pytest.raises(expected, match=r"emb\.weight got gradient by a path outside|Expanded Weights"):
        model(ids).logsumexp(-1).sum().backward()
        optimizer.step()
    assert_unchanged(model, before)


@pytest.mark.parametrize("mode", MODES)
def test_penalty_on_a_weight_in_the_loss_is_refused(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    model, optimizer, _ = private(model, mode, data)
    before = snapshot(model)
    loss = model(torch.randn(6, 4)).pow(2).sum() + 0.1 * model[0].weight.pow(2).sum()
    with pytest.raises(PerSampleGradientError, match=r"0\.weight got gradient by a path outside"):
        loss.backward()
        optimizer.step()
    assert_unchanged(model, before)


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost", "functorch"])  # ew expands whatever is trainable at each forward
def test_parameter_unfrozen_after_attach_and_used_in_eval_mode_is_refused(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    model, optimizer, _ = private(model, mode, data)
    model[0].requires_grad_(True)
    model[0].eval()
    before = snapshot(model)
    with pytest.raises(PerSampleGradientError, match=r"0\.weight.*no per-sample gradient"):
        model(torch.randn(6, 4)).pow(2).sum().backward()
        optimizer.step()
    assert_unchanged(model, before)


def test_parameter_unfrozen_after_attach_in_train_mode_is_captured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        model[0].requires_grad_(True)
        x = torch.randn(5, 4)
        model(x).pow(2).sum().backward()
        assert hooks.grad_samples[model[0].weight].shape == (5, 8, 4)


class TwoHeads(nn.Module):
    def __init__(self, frozen_trunk=False):
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.trunk.requires_grad_(not frozen_trunk)
        self.a = nn.Linear(8, 2)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.a(h), self.b(h)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frozen_trunk", [False, True])
def test_second_backward_through_one_forward_is_refused(mode, frozen_trunk):
    """Two losses backpropagated separately would clip each sample twice (2 C per step)."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    model, optimizer, _ = private(TwoHeads(frozen_trunk), mode, data)
    before = snapshot(model)
    out_a, out_b = model(torch.randn(6, 4))
    out_a.pow(2).sum().backward(retain_graph=True)
    with pytest.raises(PerSampleGradientError, match="second backward pass went through the same forward"):
        out_b.pow(2).sum().backward()
    optimizer.zero_grad()
    assert_unchanged(model, before)


@pytest.mark.parametrize("mode", MODES)
def test_retain_graph_twice_is_refused(mode):
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    model, optimizer, _ = private(nn.Sequential(nn.Linear(4, 3)), mode, data)
    loss = model(torch.randn(6, 4)).pow(2).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(PerSampleGradientError, match="second backward pass"):
        loss.backward()


@pytest.mark.parametrize("mode", MODES)
def test_summed_losses_and_separate_forwards_still_train(mode):
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    model, optimizer, loader = private(TwoHeads(), mode, data)
    before = snapshot(model)
    (x,) = next(iter(loader))  # one Poisson draw of the private loader, in two rounds
    assert len(x) >= 2
    for rows in (x[: len(x) // 2], x[len(x) // 2 :]):  # virtual steps: one backward per forward
        out_a, out_b = model(rows)
        (out_a.pow(2).sum() + out_b.pow(2).sum()).backward()
    optimizer.step()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_gives_a_noise_only_update(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    model, optimizer, _ = private(model, mode, data)
    model(torch.randn(0, 4)).pow(2).sum().backward()
    assert optimizer.hooks.batch_size == 0
    optimizer.step()
    for p in model.parameters():
        assert torch.isfinite(p.grad).all() and torch.count_nonzero(p.grad) == p.numel()


@pytest.mark.parametrize("wrap_model", [True, False])
def test_make_private_twice_on_the_same_model_is_refused(wrap_model):
    """A second engine would clip and noise every step twice, and both would count."""
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    model = nn.Sequential(nn.Linear(4, 3))
    first = PrivacyEngine()
    private_model, optimizer, loader = first.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=data,
        noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=wrap_model,
    )
    target = private_model if wrap_model else model  # wrap_model=False returned the controller; the model is `model`
    with pytest.raises(RuntimeError, match="already private"):
        PrivacyEngine().make_private(
            module=target, optimizer=torch.optim.SGD(target.parameters(), lr=0.1), data_loader=data,
            noise_multiplier=1.0, max_grad_norm=1.0,
        )
    first.detach()


def test_dp_optimizer_keeps_unseen_paths_refused_with_a_default_controller():
    """GradSampleHooks' default (hooks mode) keeps autograd's p.grad; under the DP optimizer it may not."""
    from dptorch.optim.optimizer import DPOptimizer

    model = TiedHead()
    hooks = GradSampleHooks(model, loss_reduction="sum")
    assert hooks.keep_param_grads
    DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=1.0, max_grad_norm=1.0,
                expected_batch_size=4, loss_reduction="sum")
    with pytest.raises(PerSampleGradientError, match="path outside"):
        model(torch.randint(0, 11, (4, 5))).logsumexp(-1).sum().backward()
    hooks.cleanup()
