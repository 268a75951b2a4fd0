"""Rows of a micro-batch cut from the draw are taken as a forward's batch only where every operation
on the way said where the rows went.

A slice of the draw (``x[:3]``) is tagged "some rows of the batch, which" (an ordered ``Lost``), and a
root forward whose batch is exactly those rows takes such tensors as batched along the tag's dim. Before
this, an operation without a rule for rows (a transpose, ``W @ x``, a flip, a matmul) carried the tag
unchanged, so with a micro-batch of 3 rows and 3 features ``model(x[:3], x[:3].t())`` took the transpose,
each row holding one feature of every sample, as batched, and ``a * c`` trained with every sample in every
other's gradient.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dptorch import PrivacyEngine
from dptorch.data import DPDataLoader
from dptorch.grad_sample import PerSampleGradientError

MODES = ["hooks", "bk", "functorch"]
N, D = 6, 3  # micro-batches of 3 rows: a (3, 3) tensor has as many rows as a micro-batch along both dims


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2)

    def forward(self, x, c):
        return self.lin(x * c)


def _grads(mode: str, second, cut) -> list:
    """One noiseless step of make_private, one forward and backward per micro-batch ``x[rows]``, the model's
    second input ``second(x[rows])``."""
    torch.manual_seed(0)
    model = TwoInputs()
    data = TensorDataset(torch.randn(N, D, generator=torch.Generator().manual_seed(1)), torch.zeros(N))
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0
        _, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DPDataLoader(data, sample_rate=1.0, steps=1), noise_multiplier=0.0, max_grad_norm=1.0,
            loss_reduction="sum", grad_sample_mode=mode, wrap_model=False)
    try:
        for x, _ in loader:
            for rows in cut:
                model(x[rows], second(x[rows])).pow(2).sum().backward()
            optimizer.step()
    finally:
        engine.detach()
    return [p.grad.clone() for p in model.parameters()]


HALVES = [slice(0, 3), slice(3, 6)]
MOVED = {
    "transpose": lambda m: m.t(),
    "transpose of the last two dims": lambda m: m.transpose(-1, -2),
    "matmul from the left": lambda m: torch.ones(3, 3) @ m,
    "mm": lambda m: torch.mm(torch.ones(3, 3), m),
    "flip": lambda m: m.flip(0),
    "sum over the rows, broadcast": lambda m: m.sum(0, keepdim=True) + torch.zeros(3, 3),
    "a row broadcast": lambda m: m[:1] * torch.ones(3, 1),
    "cat along the rows": lambda m: torch.cat([m[1:], m[:1]]),
    "roll": lambda m: m.roll(1, 0),
}
KEPT = {
    "scaled": lambda m: m * 2,
    "clone and cast": lambda m: m.clone().double().float(),
    "transposed twice": lambda m: m.t().t(),
    "mean over features": lambda m: m.mean(1, keepdim=True),
    "matmul from the right": lambda m: m @ torch.ones(3, 3),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("move", list(MOVED))
def test_rows_moved_by_an_operation_are_not_the_batch(move, mode):
    with pytest.raises(PerSampleGradientError):
        _grads(mode, MOVED[move], HALVES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("keep", list(KEPT))
def test_rows_kept_in_place_train_as_the_whole_draw(keep, mode):
    """Micro-batches give the whole draw's step where each row stays its sample's."""
    for got, want in zip(_grads(mode, KEPT[keep], HALVES), _grads(mode, KEPT[keep], [slice(None)])):
        torch.testing.assert_close(got, want)
