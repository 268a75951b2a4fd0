"""A small private training run that checkpoints every step; used by test_checkpoint.py.

    python -m tests.engine.checkpoint_run DIR --steps N [--kill-after K] [--resume]

With --kill-after the process SIGKILLs itself right after writing checkpoint K. The final
parameters and epsilon are written to DIR/final.pt.
"""

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-after", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    checkpoint = args.dir / "checkpoint.pt"
    step = 0
    if args.resume:
        step = engine.load_checkpoint(checkpoint, module=model, optimizer=optimizer, data_loader=loader)["step"]
    batches = iter(loader)
    while step < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        optimizer.zero_grad()
        if len(y):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        step += 1
        engine.save_checkpoint(checkpoint, module=model, optimizer=optimizer, data_loader=loader, extra={"step": step})
        if step == args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save({"params": [p.detach() for p in model.parameters()], "epsilon": engine.get_epsilon(1e-5)}, args.dir / "final.pt")


if __name__ == "__main__":
    main()
