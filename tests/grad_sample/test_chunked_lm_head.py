"""ChunkedLMHead: the LM head's cross-entropy block by block, exact against full logits and the batch-of-one reference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptorch.clipping.factors import ROUNDING_MARGIN
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.layers.chunked_lm_head import ChunkedLMHead
from tests.helpers import check_per_sample_grads, reference_per_sample_grads, single_thread  # noqa: F401

VOCAB = 37


class TinyLM(nn.Module):
    """Embedding, one mixing layer, a chunked head (tied to the embedding or its own weight)."""

    def __init__(self, width, tied, per_row):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(width, width)
        weight = self.embed.weight if tied else nn.Parameter(torch.randn(VOCAB, width) * 0.3)
        self.head = ChunkedLMHead(weight, per_row=per_row, block_elements=40)  # blocks of a few words, V not a multiple

    def hidden(self, ids):
        return torch.tanh(self.mix(self.embed(ids)))

    def forward(self, ids, targets):
        return self.head(self.hidden(ids), targets)


def batch(rows=3, tokens=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, tokens), generator=g)
    targets = torch.randint(0, VOCAB, (rows, tokens), generator=g)
    targets[0, 2] = targets[2, -1] = -100
    targets[1] = -100  # a row without any target: loss 0, gradient 0
    return ids, targets


def full_logits_losses(model, ids, targets, per_row):
    logits = model.hidden(ids) @ model.head.weight.t()
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    sums = per_token.view(targets.shape).sum(1)
    return sums if per_row == "sum" else sums / (targets != -100).sum(1).clamp(min=1)


@pytest.mark.parametrize("per_row", ["mean", "sum"])
def test_losses_and_gradients_equal_the_full_logits_cross_entropy(per_row):
    torch.manual_seed(0)
    model = TinyLM(8, tied=False, per_row=per_row)
    ids, targets = batch()
    got = model(ids, targets)
    want = full_logits_losses(model, ids, targets, per_row)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got[1] == 0
    weights = torch.rand(3)
    params = list(model.parameters())
    got_grads = torch.autograd.grad((got * weights).sum(), params)
    want_grads = torch.autograd.grad((full_logits_losses(model, ids, targets, per_row) * weights).sum(), params)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_targets_it_is_the_plain_head():
    torch.manual_seed(0)
    model = TinyLM(8, tied=False, per_row="mean")
    hidden = torch.randn(2, 4, 8)
    torch.testing.assert_close(model.head(hidden), hidden @ model.head.weight.t())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("per_row", ["mean", "sum"])
def test_hooks_mode_per_sample_grads_match_the_batch_of_one_reference(tied, per_row):
    torch.manual_seed(0)
    model = TinyLM(8, tied=tied, per_row=per_row)
    check_per_sample_grads(model, batch(), loss_fn=lambda losses: losses, loss_reduction="sum")


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("width", [4, 16])  # tokens >= width: instantiated blocks; tokens < width: Gram sums
@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_norms_and_clipped_sums_match_the_batch_of_one_reference(mode, tied, width, loss_reduction):
    torch.manual_seed(0)
    model = TinyLM(width, tied=tied, per_row="mean")
    ids, targets = batch(tokens=6)
    expected = reference_per_sample_grads(model, (ids, targets), lambda losses: losses)
    hooks = GradSampleHooks(model, loss_reduction=loss_reduction, grad_sample_mode=mode)
    try:  # the controller reports each sample's own loss gradient, whatever the reduction
        losses = model(ids, targets)
        (losses.sum() if loss_reduction == "sum" else losses.mean()).backward()
        norms = hooks.per_sample_norms()
        factors = {p: torch.rand(3) for p in norms}
        sums = hooks.clipped_sums(factors)
        for p, want in expected.items():
            torch.testing.assert_close(norms[p].double(), want.double().flatten(1).norm(dim=1),
                                       rtol=1e-4, atol=1e-7)
            torch.testing.assert_close(sums[p], torch.einsum("i,i...->...", factors[p], want),
                                       rtol=1e-4, atol=1e-6)
        assert set(expected) == set(norms)
        head = model.head.weight
        for i in (0, 2):  # the certified norm: what is summed for a sample at factor 1 is within it (clip margin)
            added = hooks.clipped_sums({p: (torch.arange(3) == i).float() for p in norms})[head]
            assert added.double().norm() <= norms[head][i].double() * (1 + ROUNDING_MARGIN)
    finally:
        hooks.cleanup()


def test_packed_examples_in_one_row_are_refused():
    torch.manual_seed(0)
    model = TinyLM(8, tied=False, per_row="sum")
    ids, targets = batch()
    hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode="bk")
    try:
        hooks.set_privacy_units(torch.tensor([[0, 0, 0, 1, 1, 1]] * 3) + torch.arange(3).view(3, 1) * 2)
        with pytest.raises(PerSampleGradientError, match="mixes token positions"):
            model(ids, targets).sum().backward()
    finally:
        hooks.cleanup()


def test_a_head_with_a_bias_or_mismatched_targets_is_refused():
    with pytest.raises(ValueError, match="bias-free"):
        ChunkedLMHead.from_linear(nn.Linear(4, VOCAB))
    head = ChunkedLMHead.from_linear(nn.Linear(4, VOCAB, bias=False))
    with pytest.raises(ValueError, match="do not match"):
        head(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
