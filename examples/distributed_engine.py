"""DP-SGD with ``PrivacyEngine`` on several processes: DDP, or FSDP2 (``fully_shard``) with ``--fsdp``.

    torchrun --nproc-per-node 2 examples/distributed_engine.py            # DDP
    torchrun --nproc-per-node 2 examples/distributed_engine.py --fsdp     # FSDP2, per layer and root
    accelerate launch --config_file examples/accelerate_ddp.yaml examples/distributed_engine.py

A small classifier on synthetic data (two Gaussian classes). What changes against one process:
the model is wrapped (DDP) or sharded (FSDP2) *before* ``make_private``, the optimizer is built
from the wrapped model's parameters, and the data loader becomes a distributed Poisson loader
(each rank samples its own rows with the global rate q). ``BatchMemoryManager`` pads every rank
to the same number of physical batches per step, and the loop runs forward and backward on each
of them, empty ones included (FSDP2 gathers parameters in every forward).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import BatchMemoryManager, PrivacyEngine


def data(count: int = 2048):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (count,), generator=g)
    features = torch.randn(count, 16, generator=g) + 1.5 * labels[:, None] * torch.linspace(-1, 1, 16)
    return TensorDataset(features, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of replicating with DDP")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--mode", default="bk", help="grad_sample_mode: hooks, bk, ghost")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun / accelerate launch set RANK, WORLD_SIZE, MASTER_ADDR/PORT
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights everywhere
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 2))
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(data(), batch_size=128)  # expected logical (global) batch: 128 rows
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        grad_sample_mode=args.mode,
    )
    criterion = nn.CrossEntropyLoss(reduction="mean")
    for epoch in range(args.epochs):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=32, optimizer=optimizer) as batches:
            for x, y in batches:
                loss = criterion(model(x), y) if len(x) else model(x).sum()  # an empty batch still runs
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        if rank == 0:
            print(f"epoch {epoch}: epsilon = {engine.get_epsilon(1e-5):.3f} after {engine.plan.steps} steps")
    with torch.no_grad():
        x, y = data(512).tensors
        accuracy = (model(x).argmax(-1) == y).float().mean().item()
    if rank == 0:
        kind = "FSDP2" if args.fsdp else "DDP"
        print(f"{kind} on {dist.get_world_size()} processes: accuracy {accuracy:.2f}, "
              f"epsilon = {engine.get_epsilon(1e-5):.3f} at delta = 1e-5")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
