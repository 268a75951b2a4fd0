"""Opacus' tutorials' ``DELTA = 1 / len(train_dataloader)`` is refused, with a message naming the idiom and the fix."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine


def tutorial_setup():
    """The text-classifier tutorial's shape: 512 rows, batches of 32, so len(train_dataloader) == 16."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    loader = DataLoader(TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,))), batch_size=32)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loader


def test_calibrating_at_one_over_the_number_of_batches_is_refused_with_the_idiom_and_the_fix():
    model, optimizer, loader = tutorial_setup()
    delta = 1 / len(loader)
    weights = model.weight.detach().clone()
    with pytest.raises(ValueError) as caught:
        PrivacyEngine().make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=8.0, target_delta=delta,
            epochs=1, max_grad_norm=1.0,
        )
    message = str(caught.value)
    assert "not below 1/N for N=512" in message
    assert "DELTA = 1 / len(train_dataloader)" in message and "1 / (10 * len(train_dataloader.dataset))" in message
    assert torch.equal(model.weight, weights) and not model._forward_hooks  # refused before anything is attached


def test_reporting_at_one_over_the_number_of_batches_is_refused_and_a_delta_below_one_over_n_is_not():
    model, optimizer, loader = tutorial_setup()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
    )
    with pytest.raises(ValueError, match=r"len\(train_dataloader\)"):
        engine.get_epsilon(1 / len(loader))
    assert engine.get_epsilon(1 / (10 * len(loader.dataset))) == 0.0  # no step taken yet
