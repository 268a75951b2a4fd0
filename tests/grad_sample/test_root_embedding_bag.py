"""An ``nn.EmbeddingBag`` that is the whole model, called with 1-D input and offsets: one bag, one sample.

The batch is the offsets (one per bag), never the flat index tensor, even when the two have the same length.
"""

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError

CASES = [
    (torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([0, 2, 3])),  # 7 indices in 3 bags
    (torch.tensor([4, 9, 4]), torch.tensor([0, 0, 2])),  # 3 indices in 3 bags, the first empty
]


def per_bag_reference(emb: nn.EmbeddingBag, indices, offsets, weights):
    """Each bag's weight gradient alone (a batch of one bag)."""
    bounds = offsets.tolist() + [len(indices)]
    rows = []
    for i in range(len(offsets)):
        emb.zero_grad()
        (emb(indices[bounds[i]:bounds[i + 1]], torch.tensor([0])) * weights[i]).sum().backward()
        rows.append(emb.weight.grad.clone())
    emb.zero_grad()
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("indices,offsets", CASES)
@pytest.mark.parametrize("grad_sample_mode", ["hooks", "bk"])
def test_each_bag_is_one_sample(mode, indices, offsets, grad_sample_mode):
    torch.manual_seed(0)
    emb = nn.EmbeddingBag(20, 5, mode=mode)
    weights = torch.randn(len(offsets), 5)
    want = per_bag_reference(emb, indices, offsets, weights)
    hooks = GradSampleHooks(emb, loss_reduction="sum", grad_sample_mode=grad_sample_mode)
    ((emb(indices, offsets) * weights).sum(1)).sum().backward()
    assert hooks.batch_size == len(offsets)
    got = hooks.per_sample_norms()[emb.weight]
    torch.testing.assert_close(got, want.flatten(1).norm(dim=1), rtol=1e-5, atol=1e-7)
    if grad_sample_mode == "hooks":
        torch.testing.assert_close(hooks.grad_samples[emb.weight], want, rtol=1e-5, atol=1e-7)
    hooks.cleanup()


def test_bags_mixed_in_the_loss_are_refused():
    emb = nn.EmbeddingBag(20, 5)
    hooks = GradSampleHooks(emb, loss_reduction="sum")
    out = emb(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1]))
    with pytest.raises(PerSampleGradientError, match="couples every sample"):
        (out.sum(0) ** 2).sum().backward()  # a product of the bags' sums: the samples meet before the loss
    hooks.cleanup()
