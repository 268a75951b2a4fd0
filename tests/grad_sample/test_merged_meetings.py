"""Shared tensors meeting the batch where it is merged with an inner dim, and layers fed only shapes.

Against the batch-of-one oracle, at T == n and T != n: a layer whose arguments carry the batch but
give it only their shapes (BART's learned positions); a shared bias broadcast against a batch
merged with windows (Swin); a shared projection repeated once per sample along a batch merged with
heads (DeBERTa-v2's relative positions). Siblings that really mix the samples stay refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError
from dptorch.grad_sample.tracking import rows_to_dense
from tests.grad_sample.oracle import assert_exact
from tests.helpers import projection_loss, single_thread  # noqa: F401  (autouse: one intra-op thread)

MODES = ["hooks", "bk", "ghost", "functorch"]
SIZES = [(3, 3), (2, 4), (4, 2)]  # (n, T): T == n first
VOCAB, D = 11, 8


class ShapePositions(nn.Embedding):
    """BART's learned positions: called on ``input_ids``, reads only their length."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=self.weight.device)
        return super().forward(positions + 1).unsqueeze(0)  # (1, T, d): no batch


class BartLike(nn.Module):
    def __init__(self, positions: nn.Module = None):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = positions if positions is not None else ShapePositions(8, D)
        self.out = nn.Linear(D, VOCAB)

    def forward(self, ids):
        return self.out(torch.tanh(self.tok(ids) + self.pos(ids)))


def relative_index(window: int) -> torch.Tensor:
    """``(w, w)`` indices into a table of ``2w - 1`` relative offsets (a constant: no batch)."""
    offsets = torch.arange(window)
    return offsets[:, None] - offsets[None, :] + window - 1


class WindowBias(nn.Module):
    """Swin's pattern: rows merged with windows ``(B * W, w, d)``; a bias table indexed by a constant
    index, of shape ``(1, w, w)``, broadcast against the scores of every window of every sample."""

    def __init__(self, window: int = 2):
        super().__init__()
        self.window = window
        self.inp = nn.Linear(D, D)
        self.table = nn.Parameter(torch.randn(2 * window - 1))
        self.register_buffer("index", relative_index(window), persistent=False)
        self.out = nn.Linear(D, D)

    def bias(self) -> torch.Tensor:
        return self.table[self.index].unsqueeze(0)

    def forward(self, x):
        b, t, d = x.shape
        h = self.inp(x).reshape(b * t // self.window, self.window, d)  # (B * W, w, d): the batch merged
        scores = h @ h.transpose(1, 2) + self.bias()
        return self.out(scores.softmax(-1) @ h).reshape(b, t, d)


class BiasTable(nn.Module):
    """The bias table as a layer of its own (Swin's ``SwinRelativePositionBias``): a call fed no batch."""

    def __init__(self, window: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * window - 1))
        self.register_buffer("index", relative_index(window), persistent=False)

    def forward(self) -> torch.Tensor:
        return self.table[self.index].unsqueeze(0)


class WindowBiasLayer(WindowBias):
    def __init__(self, window: int = 2):
        super().__init__(window)
        del self.table
        self.table_layer = BiasTable(window)

    def bias(self) -> torch.Tensor:
        return self.table_layer()


class RepeatedHeads(nn.Module):
    """DeBERTa-v2's pattern: shared relative embeddings, normalised and projected without a batch, split
    into heads ``(H, P, dh)`` and repeated once per sample, meet the queries ``(B * H, T, dh)``."""

    def __init__(self, heads: int = 2, span: int = 3):
        super().__init__()
        self.heads = heads
        self.rel = nn.Parameter(torch.randn(span, D))
        self.norm = nn.LayerNorm(D)
        self.pos_proj = nn.Linear(D, D)
        self.query = nn.Linear(D, D)
        self.out = nn.Linear(span * heads, D)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.query(x).view(b, t, self.heads, -1).transpose(1, 2).reshape(b * self.heads, t, -1)
        pos = self.pos_proj(self.norm(self.rel))  # a chain of calls fed no batch
        pos = pos.view(pos.shape[0], self.heads, -1).transpose(0, 1)  # (H, P, dh)
        pos = pos.repeat(b, 1, 1)  # (B * H, P, dh)
        scores = torch.bmm(q, pos.transpose(1, 2))  # (B * H, T, P)
        return self.out(scores.view(b, self.heads, t, -1).transpose(1, 2).reshape(b, t, -1))


def ids(n, t):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(n * 7 + t))


def features(n, t):
    return torch.randn(n, t, D, generator=torch.Generator().manual_seed(n * 7 + t))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,t", SIZES)
def test_layer_fed_only_shapes_is_exact(mode, n, t):
    torch.manual_seed(0)
    assert_exact(BartLike(), (ids(n, t),), (0,), projection_loss, mode, n)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,t", [(4, 4), (2, 4), (3, 6)])  # two or three windows of 2 per sample
@pytest.mark.parametrize("build", [WindowBias, WindowBiasLayer], ids=["table", "table layer"])
def test_bias_broadcast_over_windows_is_exact(build, mode, n, t):
    torch.manual_seed(0)
    assert_exact(build(), (features(n, t),), (0,), projection_loss, mode, n)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,t", SIZES)
def test_shared_rows_repeated_per_sample_are_exact(mode, n, t):
    """Sample ``b``'s rows ``b * H .. b * H + H - 1`` of the repeated tensor meet its own queries only:
    each group of rows gets that sample's gradient, and the chain of calls behind it is followed
    through their taps (one per-sample vector-Jacobian product, not a second backward)."""
    torch.manual_seed(0)
    assert_exact(RepeatedHeads(), (features(n, t),), (0,), projection_loss, mode, n)


def test_rows_to_dense_in_groups():
    rows = torch.arange(12.0).view(2, 6)  # along dim 1: 3 samples of 2 rows
    dense = rows_to_dense(rows, 1, 3, group=2)
    assert dense.shape == (3, 2, 6)
    for i in range(3):
        kept = torch.zeros(2, 6)
        kept[:, 2 * i:2 * i + 2] = rows[:, 2 * i:2 * i + 2]
        assert torch.equal(dense[i], kept)
    assert torch.equal(dense.sum(0), rows)


# ------------------------------------------------------------------ siblings that mix the samples


class MaxPositions(nn.Embedding):
    """Positions shifted by the largest id of the whole batch: every sample's output depends on others'."""

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1]) + input_ids.max() % 2
        return super().forward(positions).unsqueeze(0)


class BatchMeanPositions(nn.Embedding):
    """The batch's mean embedding: no batch dim left, derived from every sample."""

    def forward(self, input_ids):
        return super().forward(input_ids).mean(0, keepdim=True)


@pytest.mark.parametrize("positions", [MaxPositions, BatchMeanPositions])
@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_layer_whose_output_mixes_the_batch_is_refused(positions, mode):
    model = BartLike(positions(VOCAB, D))
    with GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum"):
        with pytest.raises(PerSampleGradientError, match=r"mixes or merges its samples \((add of the )?(max|mean) over the batch"):
            projection_loss(model(ids(3, 3))).sum().backward()


class InterleavedWindows(WindowBias):
    """Windows cut across the batch: time-major rows ``(T * B, d)`` put several samples in one window."""

    def forward(self, x):
        b, t, d = x.shape
        h = self.inp(x).transpose(0, 1).reshape(b * t // self.window, self.window, d)
        scores = h @ h.transpose(1, 2) + self.bias()
        return self.out(scores.softmax(-1) @ h).reshape(t, b, d).transpose(0, 1)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_bias_meeting_windows_that_mix_samples_is_refused(mode):
    model = InterleavedWindows()
    with GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum"):
        with pytest.raises(PerSampleGradientError, match=r"out \(Linear\).*mixes or merges its samples"):
            projection_loss(model(features(2, 2))).sum().backward()
