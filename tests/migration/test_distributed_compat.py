"""Opacus' distributed names under dptorch, in a one-process gloo group (no extra processes).

``DifferentiallyPrivateDistributedDataParallel`` is torch's DDP, which dptorch's engine and
optimizer handle; ``DistributedUniformWithReplacementSampler`` takes the rank from the group.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.accounting import RDPAccountant
from dptorch.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from dptorch.utils.uniform_sampler import DistributedUniformWithReplacementSampler


@pytest.fixture
def process_group(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_distributed_sampler_needs_a_process_group():
    with pytest.raises(ValueError, match="torch.distributed"):
        DistributedUniformWithReplacementSampler(total_size=100, sample_rate=0.1)


def test_distributed_sampler_takes_opacus_keywords(process_group):
    sampler = DistributedUniformWithReplacementSampler(
        total_size=500, sample_rate=0.1, shuffle=True, shuffle_seed=3, generator=torch.Generator().manual_seed(0)
    )
    assert (sampler.rank, sampler.world_size, sampler.num_samples, sampler.sample_rate) == (0, 1, 500, 0.1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 10
    assert 20 < sum(map(len, batches)) / 10 < 80 and all(0 <= i < 500 for b in batches for i in b)


def test_dpddp_model_trains_privately_through_make_private(process_group):
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(128, 6), torch.randint(0, 2, (128,)))
    model = DPDDP(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=32),
        noise_multiplier=1.0, max_grad_norm=1.0,
    )
    assert loader.distributed and loader.world_size == 1
    before = [p.detach().clone() for p in optimizer.params]
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, optimizer.params))
    reference = RDPAccountant()
    reference.step(noise_multiplier=1.0, sample_rate=0.25, num_steps=4)
    assert engine.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)
    engine.detach()
