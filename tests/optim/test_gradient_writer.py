"""The DP optimizer's gradient writer: asked to keep every backward pass's sums (phantoms too) and to write the step."""

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.noise import NoiseGenerator
from dptorch.optim import DPOptimizer
from dptorch.optim.gradient_writer import WholeParameters


class Recording(WholeParameters):
    """Whole parameters, with a log of what the optimizer asked; ``takes``: parameters it keeps itself (doubled)."""

    def __init__(self, takes=()):
        self.log, self.takes, self.kept = [], set(takes), {}

    def keep(self, optimizer, hooks, factors, dropped=None):
        self.log.append(("keep", len(factors)))
        mine = {p: f for p, f in factors.items() if p in self.takes}
        for p, s in hooks.clipped_sums(mine, dropped).items():
            self.kept[p] = self.kept.get(p, 0) + 2 * s
        return {p: f for p, f in factors.items() if p not in self.takes}

    def write(self, optimizer, params):
        self.log.append(("write", len(params)))
        super().write(optimizer, params)
        for p, s in self.kept.items():
            p.grad = s.view_as(p)
        self.kept = {}


def run(writer=None, phantom=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.7,
                            max_grad_norm=0.5, loss_reduction="sum", noise_generator=NoiseGenerator(seed=3))
    if writer is not None:
        optimizer.use_gradient_writer(writer)
    x, y = torch.randn(2, 5, 4), torch.randn(2, 5, 2)
    for step in range(2):
        for part in (x[step, :3], x[step, 3:]):  # two physical batches, one logical step
            ((model(part) - y[step, : len(part)]) ** 2).sum().backward()
        if phantom:
            with optimizer.phantom():
                (model(x[step, :1]) * 0).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_given_writer_keeps_every_pass_phantoms_included_and_writes_each_step():
    plain, optimizer = run()
    assert type(optimizer.gradient_writer) is WholeParameters
    writer = Recording()
    given, _ = run(writer)
    assert writer.log == [("keep", 4), ("keep", 4), ("keep", 0), ("write", 4)] * 2
    for a, b in zip(plain.parameters(), given.parameters()):  # the same writing: the same update, bit for bit
        assert torch.equal(a, b)


def test_what_a_writer_keeps_itself_is_its_own_and_the_rest_the_optimizer_adds_up():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1e9, loss_reduction="sum")
    weight = model[0].weight
    writer = Recording(takes=[weight])
    optimizer.use_gradient_writer(writer)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert weight not in optimizer._summed and set(optimizer._summed) == set(model.parameters()) - {weight}
    reference = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    reference.load_state_dict(model.state_dict())
    reference(x).sum().backward()
    torch.testing.assert_close(writer.kept[weight], 2 * reference[0].weight.grad, rtol=1e-6, atol=1e-7)
    optimizer.pre_step()
    torch.testing.assert_close(weight.grad, 2 * reference[0].weight.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model[2].weight.grad, reference[2].weight.grad, rtol=1e-6, atol=1e-7)


def test_a_given_writer_survives_use_hooks_and_is_refused_while_sums_are_held():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=GradSampleHooks(model, loss_reduction="sum"),
                            noise_multiplier=1.0, max_grad_norm=1.0, loss_reduction="sum")
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match="held in the current writer's layout"):
        optimizer.use_gradient_writer(Recording())
    assert type(optimizer.gradient_writer) is WholeParameters
    optimizer.zero_grad()
    writer = Recording()
    optimizer.use_gradient_writer(writer)
    optimizer.hooks.cleanup()
    optimizer.use_hooks(GradSampleHooks(model, loss_reduction="sum"))
    assert optimizer.gradient_writer is writer
