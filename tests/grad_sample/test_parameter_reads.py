"""A parameter read outside its module's call, fed without a batch to layers (DeBERTa-v2's
``rel_embeddings.weight`` into a LayerNorm and the position projections): exact against the
batch-of-one oracle at T == n and T != n; a read whose gradient reaches the weight where the samples
cannot be told apart, or a read of a module with children, stays refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError
from tests.grad_sample.oracle import assert_exact
from tests.helpers import check_per_sample_grads, projection_loss, single_thread  # noqa: F401  (autouse)

MODES = ["hooks", "bk", "ghost", "functorch"]
D, SPAN = 8, 5


class Table(nn.Module):
    """A table with a child: its own call would replay it, so a read of its weight is not followed."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(SPAN, D))
        self.scale = nn.Linear(D, D)


class ReadsWeight(nn.Module):
    """Relative embeddings whose weight is read by this module's code, normalised (or only sliced)
    and projected without a batch, meeting the batch in two products."""

    def __init__(self, norm: bool = True, direct_use: bool = False, table: bool = False):
        super().__init__()
        self.norm_rel, self.direct_use = norm, direct_use
        self.rel = Table() if table else nn.Embedding(SPAN, D)  # never called
        self.norm = nn.LayerNorm(D) if norm else nn.Identity()
        self.pos = nn.Linear(D, D)
        self.inp = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        weight = self.rel.weight
        rel = self.pos(self.norm(weight) if self.norm_rel else weight[1:].unsqueeze(0))  # (P, d) or (1, P - 1, d)
        h = self.inp(x)
        if self.direct_use:  # the weight also meets the batch itself: its gradient there is summed over samples
            h = h + weight[: x.shape[1]]
        scores = h @ rel.transpose(-1, -2)
        return self.out(scores.softmax(-1) @ rel)


def features(n, t):
    return torch.randn(n, t, D, generator=torch.Generator().manual_seed(n * 7 + t))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,t", [(3, 3), (2, 4)])
@pytest.mark.parametrize("norm", [True, False], ids=["normalised", "sliced"])
def test_weight_read_outside_its_module_is_exact(norm, mode, n, t):
    torch.manual_seed(0)
    model = ReadsWeight(norm=norm)
    assert_exact(model, (features(n, t),), (0,), projection_loss, mode, n)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_weight_read_that_also_meets_the_batch_is_refused(mode):
    model = ReadsWeight(direct_use=True)
    with GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum"):
        with pytest.raises(PerSampleGradientError, match=r"rel\.weight: the parameter is read outside its module's call.*could not be told apart"):
            projection_loss(model(features(3, 3))).sum().backward()


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_weight_of_a_module_with_children_read_outside_its_call_is_refused(mode):
    model = ReadsWeight(table=True)
    model.rel.scale.requires_grad_(False)
    with GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum"):
        with pytest.raises(PerSampleGradientError, match=r"rel\.weight received a gradient but no per-sample gradient"):
            projection_loss(model(features(3, 3))).sum().backward()


def test_a_forward_without_backward_leaves_no_stale_read():
    """A forward whose backward never runs (its graph dropped) does not spoil the next step."""
    torch.manual_seed(0)
    model = ReadsWeight()
    with GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum") as hooks:
        model(features(3, 3))
        projection_loss(model(features(2, 4))).sum().backward()
        assert hooks.per_sample_norms()[model.rel.weight].shape == (2,)
    assert not model.rel.weight._backward_hooks


def test_mean_reduction_scales_the_read_like_the_layers():
    torch.manual_seed(0)
    model = ReadsWeight()
    check_per_sample_grads(model, (features(3, 4),), loss_reduction="mean", grad_sample_mode="hooks")
