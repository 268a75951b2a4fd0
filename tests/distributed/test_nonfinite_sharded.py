"""A non-finite unit on one rank contributes zero under torch.distributed (all-reduce, FSDP2 shards).

Two gloo processes each hold three rows; one row of rank 1 has an ``inf`` feature. After one
noiseless step every rank holds the parameters that one process reaches on the five finite rows:
the rank's own clipped sum (reduce-scattered per shard under FSDP2) never sees the dropped row.
"""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.optim import DPOptimizer, NonFiniteGradientWarning
from tests.distributed.launch import run_spawned

WORLD, ROWS, CLIP = 2, 3, 0.3
SETUPS = [("allreduce", "hooks"), ("allreduce", "bk"), ("fsdp", "hooks"), ("fsdp", "bk")]


def model_like() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(WORLD * ROWS, 4, generator=g), torch.randn(WORLD * ROWS, 2, generator=g)
    x[ROWS + 1, 2] = float("inf")  # rank 1's second row
    return x, y


def step(model: nn.Module, mode: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0,
                      max_grad_norm=CLIP, loss_reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        ((model(x) - y) ** 2).sum().backward()
        opt.step()
    hooks.cleanup()
    return torch.cat([_full(p).reshape(-1) for p in model.parameters()])


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()


def worker(rank: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        x, y = data()
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        for kind, mode in SETUPS:
            model = model_like()
            if kind == "fsdp":
                from torch.distributed.fsdp import fully_shard

                fully_shard(model[0])
                fully_shard(model)
            try:
                results[(kind, mode, rank)] = step(model, mode, x[mine], y[mine])
            except Exception as err:  # reported by the test
                results[(kind, mode, rank)] = repr(err)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned():
    return run_spawned(worker, WORLD)


@pytest.mark.parametrize("kind,mode", SETUPS)
def test_a_dropped_unit_on_one_rank_leaves_every_rank_at_the_finite_rows_step(spawned, kind, mode):
    x, y = data()
    finite = torch.isfinite(x).all(1)
    want = step(model_like(), mode, x[finite], y[finite])
    for rank in range(WORLD):
        got = spawned[(kind, mode, rank)]
        assert isinstance(got, torch.Tensor), got
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(want, torch.cat([p.detach().reshape(-1) for p in model_like().parameters()]))
