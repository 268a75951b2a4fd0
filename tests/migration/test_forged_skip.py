"""Opacus' ``optimizer._step_skip_queue`` is served as it is in Opacus (``signal_skip_step`` appends to it),
and writing to it reopens nothing: a skip forged at a Poisson draw's step turns the draw into a virtual
step, and the next real step, which would then privatise several draws under one noise draw, is refused
before any parameter changes or any step is accounted."""

import pytest
import torch
from torch import nn

from dptorch import PrivacyEngine
from dptorch.plan import SamplingMismatchError


def test_a_forged_skip_is_refused_at_the_next_real_step():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    engine = PrivacyEngine()
    hooks, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        wrap_model=False)
    before = [p.detach().clone() for p in model.parameters()]
    batches = iter(loader)
    for forged in (True, False):
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
        if forged:
            optimizer._step_skip_queue.append(True)
            assert optimizer.step() is None and optimizer._is_last_step_skipped
        else:
            with pytest.raises(SamplingMismatchError, match="2 batches drawn"):
                optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert engine.get_epsilon(1e-5) == 0.0
    hooks.cleanup()
