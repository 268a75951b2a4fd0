"""bk's norm of a tied weight (the sum of its uses) is formed a block of samples at a time."""

import pytest
import torch

import dptorch.grad_sample.modes.book_keeping as book_keeping
from dptorch.grad_sample.norms.linear_forms import LinearForm
from tests.grad_sample.test_shared_inputs import _LargestFloat64


@pytest.mark.parametrize("t", [1, 6], ids=["one-token", "tokens"])
def test_tied_norm_never_copies_the_head_gradient_whole(monkeypatch, t):
    """A tied embedding and LM head: the head's ``(B, T, vocab)`` output gradient is taken a block of
    samples at a time (``WIDE_BLOCK``), and each sample's certified norm is the one formed on the
    whole batch, never below the exact norm of the summed uses."""
    torch.manual_seed(0)
    batch, vocab, d = 7, 50, 8
    ids = torch.randint(0, vocab, (batch, t))
    embedding = LinearForm(ids, torch.randn(batch, t, d))  # one-hot rows, the embedding's output gradient
    head = LinearForm(torch.randn(batch, t, vocab), torch.randn(batch, t, d))  # output gradient, input
    uses = [(1.0, embedding), (0.5, head)]
    monkeypatch.setattr(book_keeping, "WIDE_BLOCK", 1 << 30)
    with _LargestFloat64() as whole:
        want = book_keeping.shared_norm(uses)
    assert whole.largest >= batch * t * vocab  # the head's output gradient, whole
    per_sample = t * max(t, vocab + d)
    monkeypatch.setattr(book_keeping, "WIDE_BLOCK", 2 * per_sample)  # two samples a block, the last one alone
    with _LargestFloat64() as blocked:
        got = book_keeping.shared_norm(uses)
    assert 0 < blocked.largest <= 2 * per_sample
    one_hot = torch.nn.functional.one_hot(ids, vocab).double()
    summed = torch.einsum("itv,itd->ivd", one_hot, embedding.right.double()) + 0.5 * torch.einsum(
        "itv,itd->ivd", head.left.double(), head.right.double())
    exact = summed.flatten(1).norm(dim=1)
    assert got.shape == (batch,) and (got.double() >= exact).all()  # certified: never below
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
