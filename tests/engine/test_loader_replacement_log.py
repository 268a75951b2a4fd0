"""make_private says, in one log line, when it replaces the data loader's sampler by Poisson sampling."""

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.data import DPDataLoader


def make_private(loader):
    model = nn.Linear(4, 2)
    return PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)


def dataset(n):
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))


def test_a_shuffling_loader_replaced_by_poisson_sampling_is_logged_with_its_rate(caplog):
    with caplog.at_level(logging.INFO, logger="dptorch.engine"):
        _, _, loader = make_private(DataLoader(dataset(1000), batch_size=40, shuffle=True))
    replaced = [r.getMessage() for r in caplog.records if "replaced by Poisson sampling" in r.getMessage()]
    assert replaced == [f"the data loader's sampler was replaced by Poisson sampling at sample rate "
                        f"{loader.sample_rate:.4g} (expected batch {loader.sample_rate * 1000:.4g} on this process)"]
    assert loader.sample_rate == 1 / 25  # 1000 samples in batches of 40: 25 batches


def test_a_dp_data_loader_passed_in_is_kept_and_nothing_is_logged(caplog):
    given = DPDataLoader(dataset(100), sample_rate=0.1)
    with caplog.at_level(logging.INFO, logger="dptorch.engine"):
        _, _, loader = make_private(given)
    assert loader is given
    assert "replaced by Poisson sampling" not in caplog.text
