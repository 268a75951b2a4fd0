"""A model run under ``torch.compile`` after ``make_private(..., wrap_model=False)`` (the user keeps calling
their own model, compiled) is refused at its first training forward, before anything is captured; so is compiled code the tracker meets later (a compiled loss, an evaluation while the DP loader's
batch is still watched). After ``cleanup()`` compiled evaluation runs.

Measured before the refusal: at batch size 1 Dynamo compiled the code between the hooks and GPT-2's MLP
block computed a different forward (about 5e-2 off, also with an eager backend: torch 2.13's Dynamo ran
the graph a resumed ``__torch_function__`` frame compiled for one operator for another), so the clipped
update was the gradient of a wrong forward; at 2 or more rows Dynamo skipped every frame (the tracker's
dispatch guard is on the stack) and the step ran eagerly, 5x slower than eager."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import transformers

from dptorch import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError


def mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("mode", ["bk", "hooks"])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_model_compiled_after_make_private_is_refused_at_its_training_forward(mode, batch):
    torch._dynamo.reset()
    model = mlp()
    rows = TensorDataset(torch.randn(40, 6), torch.randint(0, 2, (40,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(rows, batch_size=8),
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode, wrap_model=False)
    compiled = torch.compile(model, backend="eager")
    x = next(iter(loader))[0][:batch]
    with pytest.raises(PerSampleGradientError, match="torch.compile"):
        compiled(x)
    model.eval()
    with torch.no_grad(), pytest.raises(PerSampleGradientError, match="cleanup"):
        compiled(x)  # the draw is still watched: compiled code meets the tracker
    model.train()
    model(torch.randn(3, 6)).sum()  # the controller is intact: the eager model still trains
    hooks.cleanup()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))  # after cleanup() evaluation may run compiled


@pytest.mark.parametrize("mode", ["bk", "hooks"])
@pytest.mark.parametrize("loader", [True, False])
def test_a_model_compiled_and_run_before_the_controller_attaches_trains_nothing(mode, loader):
    """Dynamo keeps a compiled frame's graph when module hooks are added later (its hook guards are off by
    default), so a compiled callable run once before the controller attached could run without the hooks: either
    way (hooks seen, or a gradient with no per-sample gradient) the step is refused before any parameter moves,
    with a DP loader's watch and without one."""
    torch._dynamo.reset()
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    compiled(torch.randn(4, 6)).sum().backward()  # compiled, run and trained through before make_private
    model.zero_grad()
    rows = TensorDataset(torch.randn(40, 6), torch.randint(0, 2, (40,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, optimizer, batches = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(rows, batch_size=8),
            noise_multiplier=0.0, max_grad_norm=1.0, grad_sample_mode=mode, wrap_model=False, loss_reduction="sum")
    x, y = next(iter(batches)) if loader else rows[:8]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PerSampleGradientError):
        nn.functional.cross_entropy(compiled(x), y, reduction="sum").backward()
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_gpt2_mlp_at_batch_size_one_under_a_compiled_step_function_is_refused():
    """The case that computed a wrong forward: GPT-2's MLP, one row, called from a compiled function."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.models.gpt2.modeling_gpt2.GPT2MLP(64, transformers.GPT2Config(n_embd=32, resid_pdrop=0))
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum", keep_param_grads=False)

    @torch.compile(backend="eager")
    def step(x):
        return model(x).pow(2).sum()

    with pytest.raises(PerSampleGradientError, match="torch.compile"):
        step(torch.randn(1, 4, 32))
    hooks.cleanup()


def test_a_compiled_loss_under_the_loss_tracker_is_refused():
    """The loss tracker follows the loss: compiled there, ``((o * 2) * 3 + 5).sum()`` of one row came out -14.80
    for 7.04 (the same Dynamo fault); a compiled loss that mixes samples is refused as well."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mlp()
    loss = torch.compile(lambda out: ((out * 2.0) * 3.0 + 5.0).sum(), backend="eager")
    mixing = torch.compile(lambda out: (out - out.mean(0)).pow(2).sum(), backend="eager")
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        for batch, compiled in ((1, loss), (8, mixing)):
            out = model(torch.randn(batch, 6))
            with pytest.raises(PerSampleGradientError, match="torch.compile"):
                compiled(out)
            hooks.clear()
        model(torch.randn(3, 6)).sum().backward()  # the controller is intact: eager training goes on
