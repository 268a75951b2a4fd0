"""Grouped privacy units (``set_privacy_units`` of one id per row; DPO's chosen and rejected rows) at
backward: the rows of one unit may meet in the loss, rows of different units may not.

Before, the loss check was skipped for grouped units; a loss mixing the pairs trained. Now the tracker
knows which unit each row is: an elementwise operation of pieces of the batch whose entries belong to the
same units in the same order (``o[:n] - o[n:]`` with rows ``i`` and ``i + n`` one unit) gives entries of one
unit each, and their sum (or their mean times its own divisor) is a sum of per-unit losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError

N = 3
PAIRS = torch.cat([torch.arange(N)] * 2)  # rows i (chosen) and i + N (rejected) are unit i


def _per_unit(loss_of, units, mode="hooks"):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x = torch.randn(2 * N, 4)
    with GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=mode) as hooks:
        hooks.set_privacy_units(units)
        loss_of(model(x).squeeze(-1), N).backward()
        if mode == "bk":  # bk keeps each unit's norm (its gradient is never formed)
            return torch.stack(list(hooks.per_sample_norms().values())).pow(2).sum(0).sqrt(), model, x
        return hooks.grad_samples[model.weight], model, x


PAIR_LOSSES = {
    "sum": lambda o, n: -F.logsigmoid(o[:n] - o[n:]).sum(),
    "mean times pairs": lambda o, n: -F.logsigmoid(o[:n] - o[n:]).mean() * n,
    "chunked": lambda o, n: (lambda c, r: -F.logsigmoid(c - r).sum())(*o.chunk(2)),
    "hinge": lambda o, n: torch.relu(1 - 0.1 * (o[:n] - o[n:])).sum(),
}


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("loss", list(PAIR_LOSSES))
def test_a_loss_per_pair_trains_each_pair_exactly(loss, mode):
    loss_of = PAIR_LOSSES[loss]
    got, model, x = _per_unit(loss_of, PAIRS, mode)
    want = []
    for i in range(N):
        alone = nn.Linear(4, 1)
        alone.load_state_dict(model.state_dict())
        rows = x[PAIRS == i]
        loss_of(alone(rows).squeeze(-1), 1).backward()
        grad = torch.cat([alone.weight.grad.flatten(), alone.bias.grad])
        want.append(grad.norm() if mode == "bk" else alone.weight.grad)
    torch.testing.assert_close(got, torch.stack(want))


COUPLING = {
    "pairs across units": lambda o, n: -F.logsigmoid(o[:n] - o[n:].flip(0)).sum(),
    "a batch mean": lambda o, n: (o[:n] - o[n:] - (o[:n] - o[n:]).mean()).pow(2).sum(),
    "a mean not undone": lambda o, n: -F.logsigmoid(o[:n] - o[n:]).mean(),
    "a mean times another number": lambda o, n: -F.logsigmoid(o[:n] - o[n:]).mean() * (n + 1),
    "a shift by a read value": lambda o, n: (o[:n] - o[n:] - float(o.mean())).pow(2).sum(),
}


@pytest.mark.parametrize("loss", list(COUPLING))
def test_a_loss_coupling_the_units_is_refused(loss):
    with pytest.raises(PerSampleGradientError):
        _per_unit(COUPLING[loss], PAIRS)


def test_rows_paired_with_rows_of_another_unit_are_refused():
    """Every row its own unit: chosen minus rejected meets two units."""
    with pytest.raises(PerSampleGradientError, match="aligned with rows of other samples"):
        _per_unit(PAIR_LOSSES["sum"], torch.arange(2 * N))


def test_interleaved_units_pair_their_own_rows():
    units = torch.arange(2 * N) // 2  # rows 2i and 2i + 1 are unit i
    got, model, x = _per_unit(lambda o, n: (o[0::2] - o[1::2]).pow(2).sum(), units)
    for i in range(N):
        alone = nn.Linear(4, 1)
        alone.load_state_dict(model.state_dict())
        (alone(x[2 * i:2 * i + 2]).squeeze(-1).diff() ** 2).sum().backward()
        torch.testing.assert_close(got[i], alone.weight.grad)


class CentredInEval(nn.Module):
    """A model whose forward, in eval mode (a reference forward in the loss phase), centres its output by a
    value read from the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        out = self.lin(x).squeeze(-1)
        return out if self.training else out - out.mean().item()


def test_a_value_read_in_a_forward_of_the_loss_phase_is_refused():
    """TRL's DPO runs the (adapter-disabled) model again without gradient for the reference log-probabilities,
    after the training forward: that forward is followed as one, and a value read there is refused."""
    model = CentredInEval()
    x = torch.randn(2 * N, 4)
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        hooks.set_privacy_units(PAIRS)
        out = model(x)
        model.eval()
        with torch.no_grad(), pytest.raises(PerSampleGradientError, match="calls item"):
            model(x)


def test_a_sum_of_means_of_different_divisors_times_one_of_them_is_refused():
    """``(a.mean() + b.mean()) * len(a)`` is not a sum when b averaged another number of entries (its weight
    would be len(a) / len(b), a ratio that may depend on the batch)."""
    def loss(o, n):
        pairs = -F.logsigmoid(o[:n] - o[n:])
        return (pairs.mean() + o.pow(2).mean()) * n

    with pytest.raises(PerSampleGradientError):
        _per_unit(loss, PAIRS)
