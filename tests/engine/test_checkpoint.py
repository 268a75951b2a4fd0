"""A run killed after step k and resumed continues exactly: same epsilon, same parameters."""

import signal
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def run(directory, *extra):
    cmd = [sys.executable, "-m", "tests.engine.checkpoint_run", str(directory), "--steps", "20", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_killed_and_resumed_run_matches_uninterrupted(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    assert run(straight).returncode == 0
    killed = run(resumed, "--kill-after", "11")  # mid-epoch: 8 batches per epoch
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (resumed / "final.pt").exists()
    finished = run(resumed, "--resume")
    assert finished.returncode == 0, finished.stderr
    a = torch.load(straight / "final.pt", weights_only=True)
    b = torch.load(resumed / "final.pt", weights_only=True)
    assert a["epsilon"] == b["epsilon"] > 0
    for p, q in zip(a["params"], b["params"]):
        assert torch.equal(p, q)
