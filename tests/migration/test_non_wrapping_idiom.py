"""Opacus 1.6's non-wrapping idiom after the rename: ``hooks, optimizer, loader =
engine.make_private(..., wrap_model=False)``, train the model itself, ``hooks.cleanup()``; the model
is then bit for bit what it was (class, attributes, state_dict keys, hooks), and attaches again."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(6, 12), nn.Linear(12, 3), nn.ReLU()

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def data():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(128, 6, generator=g), torch.randint(0, 3, (128,), generator=g)),
                      batch_size=16)


def fingerprint(model):
    """Everything cleanup must restore: class, attributes, keys, values, hooks of modules and parameters."""
    return (type(model), {name: sorted(vars(m)) for name, m in model.named_modules()},
            list(model.state_dict()), [dict(p.__dict__) for p in model.parameters()],
            [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()])


@pytest.mark.parametrize("calibrated", [False, True])
def test_the_tutorial_idiom_trains_and_cleanup_leaves_the_model_as_it_was(tmp_path, calibrated):
    torch.manual_seed(0)
    model = Classifier()
    before = fingerprint(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    engine = PrivacyEngine(accountant="rdp")
    common = dict(module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), data_loader=data(),
                  max_grad_norm=1.0, wrap_model=False)
    if calibrated:
        hooks, optimizer, loader = engine.make_private_with_epsilon(target_epsilon=3.0, target_delta=1e-5, epochs=2,
                                                                    **common)
    else:
        hooks, optimizer, loader = engine.make_private(noise_multiplier=1.0, **common)
    assert type(hooks) is GradSampleHooks and hooks is engine.hooks and hooks.module is model
    assert isinstance(model, Classifier) and list(model.state_dict()) == before[2]
    for _ in range(2):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            if len(y):
                nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert len(engine.accountant) == 2 * len(loader) and engine.get_epsilon(1e-5) > 0
    if calibrated:
        assert engine.get_epsilon(1e-5) <= 3.0
    assert any(not torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=hooks, optimizer=optimizer)  # the controller stands for the model
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["module_state_dict"]
    assert list(saved) == before[2]
    assert fingerprint(model) != before  # attached: the modules carry the controller's hooks
    hooks.cleanup()
    assert fingerprint(model) == before
    fresh = Classifier()
    fresh.load_state_dict(model.state_dict())  # the keys have no wrapper prefix
    again, _, _ = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                               data_loader=data(), noise_multiplier=1.0, max_grad_norm=1.0,
                                               wrap_model=False)
    again.cleanup()
    assert fingerprint(model) == before
