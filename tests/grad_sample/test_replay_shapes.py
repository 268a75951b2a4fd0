"""The torch.func fallback replays a layer for one sample; an argument it takes as shared but that has
the batch's rows (a mask built from the batch's shape) would make the replay count the sample once per
row. That is refused, naming the layer and the fix; the same mask derived from the batch is exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError
from tests.grad_sample.oracle import assert_exact
from tests.helpers import projection_loss, single_thread  # noqa: F401  (autouse: one intra-op thread)


class Scaled(nn.Module):
    """A layer with a direct parameter (replayed by torch.func), masked by its ``mask`` argument."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x, mask):
        return x * self.scale * mask


class Model(nn.Module):
    def __init__(self, from_shape: bool):
        super().__init__()
        self.from_shape = from_shape
        self.inner = Scaled()

    def forward(self, x):
        mask = torch.ones(x.shape[:-1] + (1,)) if self.from_shape else (x[..., :1] * 0 + 1)
        return self.inner(x, mask)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_shared_argument_with_the_batch_rows_is_refused(mode):
    model = Model(from_shape=True)
    with GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum"):
        with pytest.raises(PerSampleGradientError, match=r"Scaled, replayed for one sample.*\(3, 5, 4\) instead of the "
                                                         r"sample's \(1, 5, 4\).*attention_mask"):
            projection_loss(model(torch.randn(3, 5, 4))).sum().backward()


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_the_same_mask_derived_from_the_batch_is_exact(mode):
    torch.manual_seed(0)
    assert_exact(Model(from_shape=False), (torch.randn(3, 5, 4),), (0,), projection_loss, mode, 3)
