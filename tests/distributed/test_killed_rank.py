"""A rank killed mid-run: the others stop instead of hanging, and a fresh launch resumes from the last
engine checkpoint exactly where the uninterrupted run goes (FSDP2, 2 processes, gloo)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import ROOT, TIMEOUT_S, torchrun

SCRIPT = Path(__file__).with_name("killed_rank_script.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("killed")
    straight, _ = torchrun(SCRIPT.name, out, "straight", reports="straight")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    start = time.monotonic()
    killed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(SCRIPT), str(out), "killed"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    elapsed = time.monotonic() - start
    resumed, _ = torchrun(SCRIPT.name, out, "resumed", reports="resumed")
    return {"straight": straight, "killed": killed, "killed_s": elapsed, "resumed": resumed, "out": out}


def test_a_killed_rank_ends_the_run_instead_of_hanging(runs):
    killed = runs["killed"]
    assert killed.returncode != 0
    assert "exitcode: -9" in killed.stderr and "local_rank: 1" in killed.stderr  # rank 1 died by SIGKILL
    assert runs["killed_s"] < 120  # well inside the collectives' timeout: the survivor saw its peer go
    assert (runs["out"] / "checkpoint").is_dir()
    assert not (runs["out"] / "killed-rank0.json").exists()  # rank 0 did not finish the epoch on its own


def test_the_fresh_launch_resumes_exactly_from_the_last_checkpoint(runs):
    for straight, resumed in zip(runs["straight"], runs["resumed"]):
        torch.testing.assert_close(torch.tensor(resumed["params"]), torch.tensor(straight["params"]), rtol=0, atol=0)
        assert resumed["epsilon"] == straight["epsilon"] and resumed["steps"] == straight["steps"] > 0
