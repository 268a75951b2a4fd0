"""A buffer the training forward fills from the batch is refused, and put back (buffer_check.py).

A buffer is released with the model without noise: a hand-written running mean of the batch
would publish the batch's statistics at every step. The controller reads every buffer's batch
tag at the end of a capturing root forward, refuses one derived from the batch (written in place,
through an alias, or rebound) and first puts every buffer back as it was. A buffer written from
shared data (a step counter) trains.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from dptorch import PrivacyEngine
from dptorch.data import DPDataLoader
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError

N = 8

WRITES = {
    "running-mean": lambda m, x: m.running.mul_(0.9).add_(0.1 * x.mean(0)),
    "through-data": lambda m, x: m.running.data.copy_(x.mean(0)),
    "setitem": lambda m, x: m.running.__setitem__(slice(None), x.mean(0)),
    "through-a-view": lambda m, x: m.running.view(-1).add_(x.mean(0)),
    "one-sample-through-data": lambda m, x: m.running.data.copy_(x[0]),
    "max-over-batch": lambda m, x: m.running.copy_(x.max(0).values),
    "rebound": lambda m, x: setattr(m, "running", x.mean(0).detach()),
    "data-rebound": lambda m, x: setattr(m.running, "data", x.mean(0)),
}


class Running(nn.Module):
    """A linear layer that keeps its own statistics of its input in buffers."""

    def __init__(self, write, size: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("running", torch.zeros(size))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.write = write

    def forward(self, x):
        with torch.no_grad():
            self.steps += 1
            self.scratch.fill_(1.0)
            self.write(self, x)
        return self.lin(x)


def _data(n=N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()} | {
        k: v.clone() for k, v in model.named_buffers()}


def _assert_state(model, before):
    now = _state(model)
    assert now.keys() == before.keys()
    for k in before:
        torch.testing.assert_close(now[k], before[k], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("how", sorted(WRITES))
def test_a_buffer_written_from_the_batch_is_refused_and_put_back(mode, how):
    torch.manual_seed(0)
    model = Running(WRITES[how])
    held = model.running
    before = _state(model)
    x, y = _data()
    with GradSampleHooks(model, grad_sample_mode=mode) as hooks:
        with pytest.raises(PerSampleGradientError, match="buffer.*'running'.*put back"):
            model(x)
        _assert_state(model, before)  # the running statistics, and the step counter, as before the forward
        assert model.running is held  # a rebound buffer is the tensor it was
        assert all(p.grad is None for p in model.parameters())
        assert not hooks.grad_samples
        # the controller is ready for a forward that writes nothing of the batch
        model.write = lambda m, x: None
        F.cross_entropy(model(x), y).backward()
        assert len(hooks.per_sample_norms()) == 2


def test_the_engine_refuses_before_any_parameter_or_buffer_changes():
    torch.manual_seed(0)
    model = Running(WRITES["running-mean"])
    x, y = _data()
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DPDataLoader(TensorDataset(x, y), sample_rate=1.0, steps=1),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="bk",
    )
    before = _state(model)
    for xb, yb in loader:
        optimizer.zero_grad()
        with pytest.raises(PerSampleGradientError, match="'running'"):
            F.cross_entropy(model(xb), yb).backward()
    _assert_state(model, before)
    assert [torch.count_nonzero(v).item() for k, v in model.state_dict().items() if k.endswith("running")] == [0]


def test_a_buffer_registered_during_the_forward_is_refused_and_removed():
    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            if not hasattr(self, "mu"):
                self.register_buffer("mu", x.mean(0).detach())
            return self.lin(x)

    model = Lazy()
    x, _ = _data()
    with GradSampleHooks(model):
        with pytest.raises(PerSampleGradientError, match="'mu'"):
            model(x)
    assert "mu" not in dict(model.named_buffers())


def test_a_large_buffer_written_at_every_forward_is_put_back():
    from dptorch.grad_sample.capture.buffer_check import SMALL_BUFFER_BYTES

    size = SMALL_BUFFER_BYTES // 4 + 1  # float32: one element over the size copied at every forward
    torch.manual_seed(0)
    model = Running(lambda m, x: m.running.add_(x.mean(0).repeat(size // 4 + 1)[:size]), size=size)
    before = _state(model)
    with GradSampleHooks(model):
        with pytest.raises(PerSampleGradientError, match="put back as they were before this forward; nothing"):
            model(_data()[0])
    _assert_state(model, before)


def test_a_large_buffer_first_written_by_a_later_forward_is_named_as_not_put_back():
    from dptorch.grad_sample.capture.buffer_check import SMALL_BUFFER_BYTES

    size = SMALL_BUFFER_BYTES // 4 + 1
    torch.manual_seed(0)
    model = Running(lambda m, x: None, size=size)
    x, y = _data()
    with GradSampleHooks(model):
        F.cross_entropy(model(x), y).backward()  # writes no batch data: the large buffer is not copied again
        model.write = lambda m, x: m.running.add_(x.mean(0).repeat(size // 4 + 1)[:size])
        steps = model.steps.clone()
        with pytest.raises(PerSampleGradientError, match="not 'running'.*reload it"):
            model(x)
    assert torch.equal(model.steps, steps)  # the small buffers were put back


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_buffers_written_from_shared_data_train(mode):
    """A step counter, and an average of the (noised) parameters, are no data of the batch."""

    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))
            self.register_buffer("weight_avg", torch.zeros(3, 4))
            self.register_buffer("positions", torch.arange(4), persistent=False)

        def forward(self, x):
            with torch.no_grad():
                self.steps += 1
                self.weight_avg.mul_(0.5).add_(0.5 * self.lin.weight)
                self.positions = torch.arange(4) + self.steps
            return self.lin(x)

    torch.manual_seed(0)
    model = Counted()
    x, y = _data()
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DPDataLoader(TensorDataset(x, y), sample_rate=1.0, steps=2),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
    )
    weight = model.lin.weight.detach().clone()
    for xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    assert int(model.steps) == 2
    assert not torch.equal(model.lin.weight, weight)
    assert torch.equal(model.positions, torch.arange(4) + 2)
