"""The update is divided by a constant of the privacy plan, fixed at construction, never by a drawn batch.

Dividing the noised clipped sum by the drawn batch's size (or by an expected size recomputed from
the data) is not the subsampled Gaussian mechanism the accountant analyses (Wang et al. 2026,
arXiv 2605.15648); dividing by a public constant is post-processing of it. With the same noise
stream, a run whose first draw is empty gives ``z / B`` and a run whose draw holds ``k`` rows gives
``(S + z) / B``: their difference is exactly ``S / B`` with ``B = q * N`` for every k (0, fewer than
expected, more than expected), which fails if the divisor ever follows the batch.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dptorch import PrivacyEngine
from dptorch.data import DPDataLoader, PoissonBatchSampler
from dptorch.noise import NoiseGenerator
from dptorch.plan import PrivacyPlan

N, Q, CLIP, SIGMA = 40, 0.1, 0.05, 1.0  # B = q N = 4; a small bound: every row is clipped


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randn(N, 2, generator=g))


def model():
    torch.manual_seed(0)
    return nn.Linear(5, 2)


def first_draw(seed):
    return next(iter(PoissonBatchSampler(N, Q, seed=seed)))


def seed_whose_first_draw(rule):
    return next(seed for seed in range(10_000) if rule(len(first_draw(seed))))


def one_step_gradient(seed, mode="hooks"):
    """The gradient the first step of a mean-reduced run (loader seed ``seed``, noise seed 5) writes."""
    net = model()
    engine = PrivacyEngine()
    loader = DPDataLoader(dataset(), sample_rate=Q, seed=seed)
    _hooks, optimizer, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0), data_loader=loader, noise_multiplier=SIGMA,
        max_grad_norm=CLIP, loss_reduction="mean", grad_sample_mode=mode, wrap_model=False,
        noise_generator=NoiseGenerator(seed=5))
    x, y = next(iter(loader))
    optimizer.zero_grad()
    if len(x):
        nn.functional.mse_loss(net(x), y, reduction="mean").backward()
    optimizer.step()
    assert engine.plan.divisor == pytest.approx(Q * N, rel=1e-15)
    return torch.cat([p.grad.flatten() for p in net.parameters()]), engine.plan.divisor


def clipped_sum(rows):
    """sum_i clip_C(grad of row i's loss alone), in float64 (the batch-of-one reference)."""
    x, y = dataset().tensors
    total = None
    for i in rows:
        net = model().double()
        nn.functional.mse_loss(net(x[i:i + 1].double()), y[i:i + 1].double(), reduction="sum").backward()
        g = torch.cat([p.grad.flatten() for p in net.parameters()])
        g = g * min(1.0, CLIP / float(g.norm()))
        total = g if total is None else total + g
    return total


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_the_update_is_divided_by_q_times_n_whatever_the_drawn_batch_size(mode):
    empty = seed_whose_first_draw(lambda k: k == 0)
    few = seed_whose_first_draw(lambda k: 0 < k < Q * N)
    many = seed_whose_first_draw(lambda k: k > 2 * Q * N)
    noise_only, divisor = one_step_gradient(empty, mode)
    assert torch.count_nonzero(noise_only) == noise_only.numel()  # the empty step still adds noise (z / B)
    for seed in (few, many):
        rows = first_draw(seed)
        gradient, same_divisor = one_step_gradient(seed, mode)
        assert same_divisor == divisor
        # float32 sums and the clip factors' certified margin sit near 1e-5; a divisor of q (N +- 1) is 2.5 % off
        torch.testing.assert_close((gradient - noise_only).double(), clipped_sum(rows) / (Q * N),
                                   rtol=1e-4, atol=1e-6)
        # what a batch-size divisor would have given instead is far from it
        assert not torch.allclose((gradient - noise_only).double(), clipped_sum(rows) / len(rows), rtol=0.1)


def test_the_divisor_and_the_public_numbers_are_fixed_when_the_plan_is_built():
    plan = PrivacyPlan(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.25, num_units=40, track_draws=True)
    assert plan.divisor == plan.expected_batch_size == 10.0
    for name in ("divisor", "expected_batch_size", "sample_rate", "num_units"):
        with pytest.raises(AttributeError):
            setattr(plan, name, 3)
    for size in (0, 3, 25):  # draws of any size, empty and larger than expected
        plan.on_draw(size)
        plan.on_backward(size)
        plan.record_steps(plan.close_step())
    assert plan.divisor == 10.0 and plan.steps == 3
    given = PrivacyPlan(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=6.0)
    assert given.divisor == 6.0
    with pytest.raises(ValueError, match="expected_batch_size must be a finite number > 0"):
        PrivacyPlan(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=-2.0)
