"""Audit canaries under DDP (two gloo processes): one canary set on every rank, each sampled canary added once
to the all-reduced sum (on rank 0), the same scores everywhere (FSDP2: test_fsdp_audit.py)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from dptorch import PrivacyEngine
from dptorch.data.poisson import DPDataLoader
from tests.distributed.launch import run_spawned

WORLD, CANARIES = 2, 300


def model_like() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2))  # 610 trainable elements


def private(model, sigma, **kwargs):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 2, generator=g))
    loader = DPDataLoader(data, sample_rate=0.5, seed=3, distributed=True)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=sigma, max_grad_norm=1.0, loss_reduction="sum", audit_canaries=CANARIES, **kwargs)
    return engine, model, optimizer, loader


def canaries_only_step(rank):
    """Noise 0 and a loss of 0: the step's gradient is the canaries' sum alone."""
    engine, model, optimizer, loader = private(nn.parallel.DistributedDataParallel(model_like()), 0.0)
    x, _ = next(iter(loader))
    (0.0 * model(x).sum()).backward()
    optimizer.step()
    canaries = engine.audit_canaries
    grad = torch.cat([p.grad.reshape(-1) for p in optimizer.params])
    offsets = [sum(p.numel() for p in optimizer.params[:i]) for i in range(len(optimizer.params))]
    coordinates = torch.cat([local + offsets[i] for i, local, _ in canaries._blocks])
    order = torch.cat([canary for _, _, canary in canaries._blocks])
    elsewhere = grad.clone()
    elsewhere[coordinates] = 0
    return {"seed": canaries.seed, "included": canaries.included.clone(), "added": canaries.times_added[order].clone(),
            "at_canaries": grad[coordinates].clone(), "elsewhere": float(elsewhere.abs().max()),
            "scores": canaries.scores[order].clone(),
            "strength": float(optimizer.unit_factors(torch.tensor([10.0])) * 10.0)}  # C (1 - 2^-16): the clip rule


def noised_run(rank):
    engine, model, optimizer, loader = private(nn.parallel.DistributedDataParallel(model_like()), 1.0, audit_seed=5)
    for x, y in loader:
        ((model(x) - y) ** 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"scores": engine.audit_canaries.scores.clone(), "steps": engine.audit_canaries.steps}


def worker(rank: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        for name, run in (("canaries-only", canaries_only_step), ("noised", noised_run)):
            try:
                results[(name, rank)] = run(rank)
            except Exception as error:  # reported by the test
                results[(name, rank)] = {"error": repr(error)}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned():
    return run_spawned(worker, WORLD)


def test_each_sampled_canary_is_added_once_to_the_all_reduced_sum_on_every_rank(spawned):
    first, second = spawned[("canaries-only", 0)], spawned[("canaries-only", 1)]
    assert "error" not in first and "error" not in second, (first, second)
    assert first["seed"] == second["seed"] and torch.equal(first["included"], second["included"])
    assert torch.equal(first["added"], second["added"]) and int(first["added"].sum()) > 0
    strength = first["strength"]  # a raw 10 C clipped to C by the optimizer's rule
    assert strength == pytest.approx(1.0, rel=2e-5)
    for rank in (first, second):  # C per sampled canary, once (not once per rank), nothing anywhere else
        torch.testing.assert_close(rank["at_canaries"], first["added"].float() * strength, rtol=0, atol=0)
        assert rank["elsewhere"] == 0.0
        torch.testing.assert_close(rank["scores"], first["added"].double() * strength, rtol=1e-7, atol=0)


def test_every_rank_scores_the_same_noised_steps(spawned):
    first, second = spawned[("noised", 0)], spawned[("noised", 1)]
    assert "error" not in first and "error" not in second, (first, second)
    assert first["steps"] == second["steps"] > 0 and torch.equal(first["scores"], second["scores"])
    assert first["scores"].abs().max() > 0
