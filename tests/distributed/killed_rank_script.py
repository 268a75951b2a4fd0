"""A private FSDP2 run whose rank dies mid-epoch, under ``torchrun --nproc-per-node 2`` (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/killed_rank_script.py OUT PHASE

``straight``: two epochs of the workers' per-layer FSDP2 engine run, uninterrupted. ``killed``: the first
epoch, an engine checkpoint (``OUT/checkpoint``), then rank 1 kills itself (SIGKILL) in the middle of the
second epoch, between its backward and the step. ``resumed``: fresh processes load the checkpoint and
take the second epoch. ``straight`` and ``resumed`` write ``OUT/<phase>-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dptorch import BatchMemoryManager  # noqa: E402
from tests.distributed import workers  # noqa: E402

KILLED_AT = 2  # physical batches into the second epoch


def epoch(model, optimizer, loader, kill_at=None) -> None:
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as batches:
        for count, (x, y) in enumerate(batches):
            ((model(x) - y) ** 2).sum().backward()
            if count == kill_at and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no exception: the process is gone
            optimizer.step()
            optimizer.zero_grad()


def main(out: Path, phase: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    folder = str(out / "checkpoint")
    if phase == "resumed":
        engine, model, optimizer, loader = workers._sharded_private(seed=3, folder=folder)
        epoch(model, optimizer, loader)
    else:
        engine, model, optimizer, loader = workers._sharded_private(seed=0)
        epoch(model, optimizer, loader)
        if phase == "killed":
            engine.save_checkpoint(folder, module=model, optimizer=optimizer, data_loader=loader)
        epoch(model, optimizer, loader, kill_at=KILLED_AT if phase == "killed" else None)
    report = {"params": workers.flat_params(model).tolist(), "epsilon": engine.get_epsilon(workers.DELTA),
              "steps": engine.plan.steps}
    (out / f"{phase}-rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
