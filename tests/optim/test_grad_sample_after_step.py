"""p.grad_sample stays readable after optimizer.step() (as in Opacus) and is gone before the next forward."""

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.optim import DPOptimizer


def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    hooks = GradSampleHooks(model, grad_sample_mode="hooks", loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1e6, expected_batch_size=5, loss_reduction="sum")
    return model, hooks, optimizer


def backward(model, x):
    nn.functional.cross_entropy(model(x), torch.zeros(len(x), dtype=torch.long), reduction="sum").backward()


def test_grad_sample_after_the_step_is_the_steps_and_sums_to_its_gradient():
    model, hooks, optimizer = setup()
    x = torch.randn(5, 4)
    backward(model, x)
    held = {p: p.grad_sample.clone() for p in model.parameters()}
    optimizer.step()
    for p in model.parameters():
        assert torch.equal(p.grad_sample, held[p])
        torch.testing.assert_close(p.grad, p.grad_sample.sum(0), rtol=1e-6, atol=1e-7)  # no noise, no clipping
    optimizer.zero_grad()
    assert not any("grad_sample" in vars(p) for p in model.parameters())


def test_the_next_training_forward_drops_it_and_cleanup_leaves_nothing():
    model, hooks, optimizer = setup()
    backward(model, torch.randn(5, 4))
    optimizer.step()
    with torch.no_grad():
        model(torch.randn(2, 4))  # an evaluation forward keeps it
    assert all("grad_sample" in vars(p) for p in model.parameters())
    out = model(torch.randn(3, 4))  # a training forward, no zero_grad before it
    assert not any("grad_sample" in vars(p) for p in model.parameters())
    nn.functional.cross_entropy(out, torch.zeros(3, dtype=torch.long), reduction="sum").backward()
    assert all(p.grad_sample.shape[0] == 3 for p in model.parameters())
    optimizer.step()
    hooks.cleanup()
    assert not any("grad_sample" in vars(p) for p in model.parameters())


def test_grad_samples_lists_each_samples_own_gradient_in_the_optimizers_order():
    """Opacus' optimizer.grad_samples: p.grad_sample per parameter, each row one sample's gradient alone."""
    model, hooks, optimizer = setup()
    x = torch.randn(5, 4)
    with pytest.raises(AttributeError, match="no per-sample gradient is held"):
        optimizer.grad_samples  # before any backward pass
    backward(model, x)
    samples = optimizer.grad_samples
    assert [s.shape[1:] for s in samples] == [p.shape for p in optimizer.params]
    for i in range(len(x)):
        alone = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))  # no hooks: the plain gradient
        alone.load_state_dict(model.state_dict())
        backward(alone, x[i:i + 1])
        for sample, p in zip(samples, alone.parameters()):
            torch.testing.assert_close(sample[i], p.grad, rtol=1e-5, atol=1e-6)


def test_grad_samples_in_bk_mode_says_none_is_formed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=3, loss_reduction="sum")
    backward(model, torch.randn(3, 4))
    with pytest.raises(AttributeError, match="grad_sample_mode='hooks'"):
        optimizer.grad_samples
