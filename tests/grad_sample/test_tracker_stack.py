"""The batch tracker leaves torch's function-mode stack after every DP step (no growth, no RecursionError).

The optimizer reads the norms inside autograd's callbacks, where the mode stack reads empty: the
loss tracker must not be forgotten there while it still sits on the caller's stack.
"""

import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.optim import DPOptimizer
from tests.helpers import single_thread  # noqa: F401  (autouse fixture)


def test_the_mode_stack_does_not_grow_over_dp_steps():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    hooks = GradSampleHooks(model, grad_sample_mode="hooks", loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=1.0, max_grad_norm=0.5,
                      loss_reduction="sum")
    x = torch.randn(6, 3)
    base = torch._C._len_torch_function_stack()  # earlier tests' idle trackers may sit there (and leave)
    depths = []
    for _ in range(5):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        depths.append(torch._C._len_torch_function_stack())
    hooks.cleanup()
    assert all(d <= base for d in depths) and len(set(depths[1:])) == 1
    assert torch._C._len_torch_function_stack() <= base
