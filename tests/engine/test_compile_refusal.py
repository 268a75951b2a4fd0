"""A torch.compile'd model (or submodule) given to make_private to wrap (``wrap_model=True``) is refused, with the
reason and the fixes; ``wrap_model=False`` takes it (``test_compile_after_wrap.py``)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine


def loader():
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 6), torch.randint(0, 2, (32,))), batch_size=8)


def make_private(model, with_epsilon=False, wrap_model=True):
    engine = PrivacyEngine()
    common = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader(), max_grad_norm=1.0,
                  loss_reduction="sum", wrap_model=wrap_model)
    if with_epsilon:
        return engine.make_private_with_epsilon(**common, target_epsilon=3.0, target_delta=1e-3, epochs=1)
    return engine.make_private(**common, noise_multiplier=1.0)


@pytest.mark.parametrize("with_epsilon", [False, True])
def test_a_compiled_model_to_wrap_is_refused_with_the_fixes(with_epsilon):
    compiled = torch.compile(nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match=r"^the model is compiled with torch.compile, and make_private would wrap it "
                                         r"\(wrap_model=True\)\. Pass wrap_model=False.*_orig_mod"):
        make_private(compiled, with_epsilon)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in compiled.modules())  # nothing attached
    wrapper, optimizer, dp_loader = make_private(compiled._orig_mod, with_epsilon)  # the fixes it names: the model
    take_a_step(wrapper, optimizer, dp_loader)
    optimizer.detach()
    wrapper.hooks.cleanup()
    _, optimizer, dp_loader = make_private(compiled, with_epsilon, wrap_model=False)  # or the compiled model, unwrapped
    take_a_step(compiled, optimizer, dp_loader)


def take_a_step(call, optimizer, dp_loader):
    x, y = next(iter(dp_loader))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    nn.functional.cross_entropy(call(x), y, reduction="sum").backward()
    optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, params))


def test_a_compiled_submodule_is_named():
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    model[2] = torch.compile(model[2])
    with pytest.raises(ValueError, match=r"^submodule '2' is compiled with torch.compile"):
        make_private(model)
