"""A torch.compile'd model (or submodule) is refused by make_private, with the reason and the fix."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine


def loader():
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 6), torch.randint(0, 2, (32,))), batch_size=8)


def make_private(model, with_epsilon=False):
    engine = PrivacyEngine()
    common = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader(), max_grad_norm=1.0,
                  loss_reduction="sum")
    if with_epsilon:
        return engine.make_private_with_epsilon(**common, target_epsilon=3.0, target_delta=1e-3, epochs=1)
    return engine.make_private(**common, noise_multiplier=1.0)


@pytest.mark.parametrize("with_epsilon", [False, True])
def test_a_compiled_model_is_refused_with_the_fix(with_epsilon):
    compiled = torch.compile(nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match=r"the model is compiled with torch.compile: a private forward runs eagerly.*_orig_mod"):
        make_private(compiled, with_epsilon)
    model, optimizer, dp_loader = make_private(compiled._orig_mod, with_epsilon)  # the fix it names
    x, y = next(iter(dp_loader))
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    optimizer.step()


def test_a_compiled_submodule_is_named():
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    model[2] = torch.compile(model[2])
    with pytest.raises(ValueError, match=r"^submodule '2' is compiled with torch.compile"):
        make_private(model)
