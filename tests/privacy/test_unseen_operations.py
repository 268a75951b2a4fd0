"""Operations run with torch functions switched off (``torch._C.DisableTorchFunction``), which no
``TorchFunctionMode`` sees: the guard at torch's dispatcher (``tracking/unseen.py``) refuses them on
batch data or on tensors with a gradient, in the forward, before it (the draw's watch) and in the loss,
through make_private and its DP loader; and it is on torch's dispatch-mode stack only while the loop is
followed (not during backward or the optimizer's step, not after the controllers detach).

Before the guard, ``z - mean`` with the mean taken under DisableTorchFunction trained, 4240 times the
batch-of-one reference's tolerance away from it (the "Privacy soundness, round three" finding 4).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._C import DisableTorchFunction
from torch.utils.data import TensorDataset

from dptorch import PrivacyEngine
from dptorch.data import DPDataLoader
from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError
from dptorch.grad_sample.tracking import unseen
from tests.privacy.test_tracker_escapes import D, N, OneInput, _judge, _refused

MODES = ["hooks", "bk", "functorch"]


def _unseen(op):
    def run(t):
        with DisableTorchFunction():
            return op(t)
    return run


UNSEEN_MIXES = {
    "mean": _unseen(lambda z: z.mean(0)),
    "detached sum": _unseen(lambda z: z.detach().sum(0)),
    "numpy": lambda z: torch.from_numpy(_unseen(lambda t: t.detach().numpy().mean(0))(z)),
    "cumsum": _unseen(lambda z: z.cumsum(0)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mix", list(UNSEEN_MIXES))
def test_mixing_with_torch_functions_off_inside_the_forward_is_refused(mix, mode):
    make = UNSEEN_MIXES[mix]
    found = _judge(OneInput(lambda z: z - make(z)), lambda m, x, y: m(x).sum(), mode)
    _refused(found)
    assert "torch functions switched off" in found["message"]


@pytest.mark.parametrize("mode", MODES)
def test_mixing_with_torch_functions_off_before_the_forward_is_refused(mode):
    """The draw's watch follows the loop from the loader's hand-out: the guard is on there too."""
    make = UNSEEN_MIXES["mean"]
    found = _judge(OneInput(), lambda m, x, y: m(x - make(x)).sum(), mode)
    _refused(found)
    assert "torch functions switched off" in found["message"]


@pytest.mark.parametrize("mode", MODES)
def test_mixing_with_torch_functions_off_in_the_loss_is_refused(mode):
    make = UNSEEN_MIXES["mean"]

    def loss(m, x, y):
        out = m(x)
        return (out - make(out.detach())).pow(2).sum()

    found = _judge(OneInput(), loss, mode)
    _refused(found)
    assert "torch functions switched off" in found["message"]


class ReadsItsWeight(nn.Module):
    """Uses its Linear's weight outside the Linear's call, through an operation no mode sees."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        with DisableTorchFunction():
            w = self.lin.weight * 2
        return self.lin(x) + x @ w.t()


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_used_with_torch_functions_off_is_refused(mode):
    found = _judge(ReadsItsWeight(), lambda m, x, y: m(x).sum(), mode)
    _refused(found)
    assert "a tensor with a gradient" in found["message"]


@pytest.mark.parametrize("mode", MODES)
def test_a_constant_made_with_torch_functions_off_trains_exactly(mode):
    """Nothing of the batch or of a parameter goes in: the guard lets it run, and the step is exact."""
    def shift(z):
        with DisableTorchFunction():
            c = torch.full((D,), 0.5) * 3
        return z * c

    found = _judge(OneInput(shift), lambda m, x, y: m(x).sum(), mode)
    assert found["outcome"] == "exact", found


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_the_guard_is_on_only_while_the_loop_is_followed():
    """On the dispatch-mode stack in the forward, off in backward, off in the optimizer's step, off after
    detach; the step itself is the ordinary one."""
    torch.manual_seed(0)
    model = OneInput()
    seen = {}

    def note(where):
        def hook(*args):
            seen[where] = unseen._on_stack()
        return hook

    model.lin.register_forward_hook(note("forward"))
    model.lin.register_full_backward_pre_hook(note("backward"))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd.register_step_pre_hook(note("step"))
    data = TensorDataset(torch.randn(N, D), torch.zeros(N))
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=sgd, data_loader=DPDataLoader(data, sample_rate=1.0, steps=1),
            noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum")
    for x, _ in loader:
        seen["drawn"] = unseen._on_stack()
        model(x).sum().backward()
        seen["after backward"] = unseen._on_stack()
        optimizer.step()
        seen["after step"] = unseen._on_stack()
    engine.detach()
    seen["detached"] = unseen._on_stack()
    assert seen == {"drawn": True, "forward": True, "backward": False, "after backward": True, "step": False,
                    "after step": True, "detached": False}


def test_without_a_loader_the_guard_covers_the_forward_and_its_loss():
    model = OneInput()
    x = torch.randn(N, D)
    with GradSampleHooks(model, loss_reduction="sum"):
        out = model(x)
        assert unseen._on_stack()
        with pytest.raises(PerSampleGradientError, match="torch functions switched off"):
            UNSEEN_MIXES["mean"](out)
        out.sum().backward()
        assert not unseen._on_stack()
    assert not unseen._on_stack()
