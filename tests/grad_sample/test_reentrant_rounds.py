"""Reentrant activation checkpointing runs each checkpointed segment's backward as a pass nested in the
outer one. A round begun in such a pass (every trainable layer checkpointed, the head frozen: LoRA
adapters in checkpointed decoder layers) must end with the outer pass: before, it ended with the first
segment, the next segment began another, and the DP optimizer clipped each sample once per segment (one
sample moved a two-segment model by sqrt(2) C)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

from dptorch import PrivacyEngine
from dptorch.data import DPDataLoader


class Segments(nn.Module):
    """A frozen input layer and head around two checkpointed trainable layers."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.embed, self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.embed.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, x):
        h = self.embed(x).requires_grad_(True)  # as PEFT's enable_input_require_grads does
        h = checkpoint(self.a, h, use_reentrant=self.reentrant)
        h = checkpoint(self.b, h, use_reentrant=self.reentrant)
        return self.head(h)


def _step(reentrant: bool, mode: str, rows: int) -> torch.Tensor:
    """The update of one noiseless step of make_private (lr 1, C 1) on ``rows`` large samples."""
    torch.manual_seed(0)
    model = Segments(reentrant)
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    data = TensorDataset(torch.randn(rows, 4, generator=torch.Generator().manual_seed(1)) * 100, torch.zeros(rows))
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0
        private, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DPDataLoader(data, sample_rate=1.0, steps=1), noise_multiplier=0.0, max_grad_norm=1.0,
            loss_reduction="sum", grad_sample_mode=mode)
    try:
        for x, _ in loader:
            private(x).sum().backward()
            optimizer.step()
    finally:
        engine.detach()
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - start


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_one_sample_moves_the_model_by_at_most_c_under_reentrant_checkpointing(mode):
    update = _step(True, mode, 1)
    assert 0.99 < float(update.norm()) <= 1.0 + 1e-5  # clipped once (its raw gradient is far above C)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_reentrant_checkpointing_gives_the_step_without_it(mode):
    torch.testing.assert_close(_step(True, mode, 3), _step(False, mode, 3))
