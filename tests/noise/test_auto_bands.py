"""bands='auto' in make_private_with_epsilon: the engine runs the band count choose_bands picks."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.data.cyclic_poisson import CyclicPoissonDataLoader
from dptorch.noise.banded import choose_bands

N, BATCH, STEPS, DELTA = 240, 20, 48, 1e-5


def _private(epsilon, data_loader=None, **options):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data_loader = data_loader or DataLoader(TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,))),
                                            batch_size=BATCH)
    engine = PrivacyEngine()
    engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=data_loader,
        target_epsilon=epsilon, target_delta=DELTA, max_grad_norm=1.0, steps=STEPS, noise_mechanism="bandmf",
        bands="auto", **options,
    )
    return engine


@pytest.mark.parametrize("epsilon, banded", [(0.5, False), (8.0, True)])
def test_auto_runs_the_choice_of_lowest_expected_error(epsilon, banded):
    choice = choose_bands(target_epsilon=epsilon, target_delta=DELTA, steps=STEPS, sample_rate=BATCH / N)
    assert (choice.bands > 1) == banded  # low epsilon: the amplification lost costs more than the correlation saves
    assert min(choice.relative_errors, key=choice.relative_errors.get) == choice.bands
    engine = _private(epsilon)
    assert engine.plan.bands == choice.bands
    assert engine.plan.noise_multiplier == pytest.approx(choice.noise_multipliers[choice.bands], rel=1e-3)
    assert engine.plan.epsilon_after(STEPS, DELTA) == pytest.approx(epsilon, rel=0.02)  # the planned run


def test_auto_needs_a_target_epsilon():
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="bands='auto' chooses the bands for a target epsilon"):
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
            data_loader=DataLoader(TensorDataset(torch.randn(N, 4)), batch_size=BATCH), max_grad_norm=1.0,
            noise_mechanism="bandmf", bands="auto",
        )


def test_auto_refuses_a_loader_with_its_own_partitions():
    dataset = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    cyclic = CyclicPoissonDataLoader.from_data_loader(DataLoader(dataset, batch_size=BATCH), bands=4)
    with pytest.raises(ValueError, match="already has 4: pass a plain DataLoader, or bands=4"):
        _private(8.0, data_loader=cyclic)
