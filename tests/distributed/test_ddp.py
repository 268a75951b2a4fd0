"""Distributed DP-SGD with torch.distributed (gloo, several processes on loopback).

Each rank samples its shard with the same rate q; the DP optimizer adds up the clipped sums of
all ranks and draws the noise once, on rank 0, so every rank takes the same step.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.noise import NoiseGenerator
from dptorch.optim import DPOptimizer

WORLD = 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 5, generator=g) * torch.tensor([0.1, 1, 10, 1, 1]), torch.randn(8, 2, generator=g)


def model_like():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))


def dp_step(model, x, y, noise, wrap_ddp=False, mode="hooks"):
    target = nn.parallel.DistributedDataParallel(model) if wrap_ddp else model
    hooks = GradSampleHooks(target, loss_reduction="sum", grad_sample_mode=mode)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=noise, max_grad_norm=0.5,
                      expected_batch_size=8, noise_generator=NoiseGenerator(seed=7))
    ((target(x) - y) ** 2).sum().backward()
    opt.step()
    hooks.cleanup()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def worker(rank, port, results, wrap_ddp, mode):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    x, y = data()
    shard = slice(rank, None, WORLD)
    results[rank] = dp_step(model_like(), x[shard], y[shard], noise=0.0, wrap_ddp=wrap_ddp, mode=mode)
    results[WORLD + rank] = dp_step(model_like(), torch.zeros(0, 5), torch.zeros(0, 2), noise=1.0, mode=mode)
    dist.destroy_process_group()


@pytest.mark.parametrize("wrap_ddp,mode", [(False, "hooks"), (True, "hooks"), (False, "bk")], ids=["hooks", "ddp-hooks", "bk"])
def test_ranks_agree_and_equal_one_process_on_the_whole_batch(wrap_ddp, mode):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(free_port(), results, wrap_ddp, mode), nprocs=WORLD, join=True)
    x, y = data()
    single = dp_step(model_like(), x, y, noise=0.0)
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], single, rtol=1e-5, atol=1e-6)
    # Noise drawn once across ranks: both ranks got the same noise, which is rank 0's draw alone.
    torch.testing.assert_close(results[WORLD], results[WORLD + 1])
    start = torch.cat([p.detach().flatten() for p in model_like().parameters()])
    alone = dp_step(model_like(), torch.zeros(0, 5), torch.zeros(0, 2), noise=1.0)
    torch.testing.assert_close(results[WORLD] - start, alone - start, rtol=1e-5, atol=1e-6)
