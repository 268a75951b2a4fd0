"""A model compiled after ``make_private(..., wrap_model=False)`` (the user keeps calling their own model)
trains as the eager model does: the same clipped, noise-free update over Poisson batches of changing
size, and an operation that mixes samples is refused as in eager mode.

Not yet at batch size 1: there the tracker's guard of unseen operations (a dispatch mode, on only for
batches of 2 or more) is off, so Dynamo compiles graphs between the hooks, and GPT-2's MLP then
computes a different forward (xfail below). At 2 or more Dynamo skips every frame while that dispatch
mode is on the stack, and the model runs eagerly."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import transformers

from dptorch import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.optim import DPOptimizer


class Centred(nn.Module):
    """Subtracts the batch mean between two layers: every sample's output depends on every other sample."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        return self.second(hidden - hidden.mean(0, keepdim=True))


def train(model, mode, compiled, steps=3):
    """The parameters' change after ``steps`` clipped steps, lr 1, no noise, and the batch sizes drawn."""
    torch.manual_seed(0)
    rows = TensorDataset(torch.randn(40, 6), torch.randint(0, 2, (40,)))
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0's warning: clipping alone is what is compared
        hooks, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(rows, batch_size=8),
            noise_multiplier=0.0, max_grad_norm=0.05, grad_sample_mode=mode, wrap_model=False)
    call = torch.compile(model) if compiled else model
    sizes = []
    for x, y in loader:
        if not len(x):
            continue
        optimizer.zero_grad()
        nn.functional.cross_entropy(call(x), y).backward()
        optimizer.step()
        sizes.append(len(x))
        if len(sizes) == steps:
            break
    hooks.cleanup()
    return [p.detach() - b for p, b in zip(model.parameters(), before)], sizes


def mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_compiled_after_make_private_gives_the_eager_update(mode):
    eager, eager_sizes = train(mlp(), mode, compiled=False)
    compiled, compiled_sizes = train(mlp(), mode, compiled=True)
    assert compiled_sizes == eager_sizes and len(set(eager_sizes)) > 1  # the same draws, of changing size
    assert any(d.abs().max() > 0 for d in eager)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_sample_mixing_model_compiled_after_make_private_is_refused():
    with pytest.raises(PerSampleGradientError):
        train(Centred(), "bk", compiled=False, steps=1)
    torch._dynamo.reset()
    with pytest.raises(PerSampleGradientError):
        train(Centred(), "bk", compiled=True, steps=1)


def one_step_at_batch_size_one(mode, compiled):
    """GPT-2's MLP block, hooks and the DP optimizer as make_private(..., wrap_model=False) builds them: the
    output of one step on a batch of 1 and the clipped, noise-free update."""
    torch.manual_seed(0)
    model = transformers.models.gpt2.modeling_gpt2.GPT2MLP(64, transformers.GPT2Config(n_embd=32, resid_pdrop=0))
    before = [p.detach().clone() for p in model.parameters()]
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum", keep_param_grads=False)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=0.05, expected_batch_size=1, loss_reduction="sum")
    torch._dynamo.reset()
    output = (torch.compile(model) if compiled else model)(torch.randn(1, 4, 32))
    output.pow(2).sum().backward()
    optimizer.step()
    hooks.cleanup()
    return output.detach(), [p.detach() - b for p, b in zip(model.parameters(), before)]


@pytest.mark.xfail(strict=True, reason="at batch size 1 Dynamo compiles graphs between the hooks (the guard of unseen "
                   "operations is off) and GPT-2's MLP computes a different output (about 5e-2 off, also with an eager "
                   "backend; torch 2.13's Dynamo runs the graph a resumed __torch_function__ frame compiled for one operator for "
                   "another: under a mode that breaks the graph, (x * 2.0) * 3.0 + 5.0 compiles to 60 at x = 2): the "
                   "compiled-after path is exact only because it runs eagerly at 2 or more (issue 45)")
def test_at_batch_size_one_a_model_compiled_after_the_hooks_gives_the_eager_output_and_update():
    eager_output, eager_update = one_step_at_batch_size_one("bk", compiled=False)
    compiled_output, compiled_update = one_step_at_batch_size_one("bk", compiled=True)
    torch.testing.assert_close(compiled_output, eager_output, rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled_update, eager_update):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
