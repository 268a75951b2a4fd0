"""Start a test script under ``torchrun --nproc-per-node WORLD`` (gloo, CPU) and read what each rank wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
TIMEOUT_S = 240  # a hang (unpaired collectives) fails the test instead of blocking the suite


def torchrun(script: str, out: Path, *args: str, reports: str, world: int = WORLD) -> Tuple[List[dict], str]:
    """Run ``tests/distributed/<script> OUT *args`` on ``world`` processes; return the ranks'
    ``OUT/<reports>-rank<r>.json`` and the stdout (the Trainer prints its logs from rank 0 only)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # an optional extra's folder stays
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    # --standalone: torchrun binds a free port itself (no race with another run picking the same one)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(Path(__file__).with_name(script)), str(out), *args]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{script} {' '.join(args)} did not finish within {TIMEOUT_S} s:\n{str(error.stderr)[-4000:]}")
    if done.returncode != 0:
        pytest.fail(f"torchrun {script} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return [json.loads((out / f"{reports}-rank{rank}.json").read_text()) for rank in range(world)], done.stdout


def run_spawned(worker, world: int, store: bool = True) -> dict:
    """Run ``worker(rank, place, results)`` on ``world`` processes started by ``torch.multiprocessing``
    (``place``: a file for a gloo ``FileStore`` when ``store``, else a scratch folder) and return what
    the ranks put in ``results``; skips where gloo is not available."""
    import tempfile

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as folder:
        results = manager.dict()
        mp.spawn(worker, args=(os.path.join(folder, "store") if store else folder, results), nprocs=world, join=True)
        return dict(results)
