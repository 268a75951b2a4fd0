"""DPTrainer under ``torchrun --nproc-per-node 2`` (DDP, gloo, CPU): a tiny LoRA Llama, one launch.

The script (``hf_ddp_script.py``) trains 4 steps with a checkpoint at step 2, then resumes from it
in a second trainer; each rank reports what it saw and where it ended.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dptorch.data.poisson import PoissonBatchSampler  # noqa: E402

SCRIPT = Path(__file__).with_name("hf_ddp_script.py")
ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-ddp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    # --standalone: torchrun binds a free port itself (no race with another run picking the same one)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
               str(SCRIPT), str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    return reports, done.stdout


def expected_micro_batches(report, rank):
    """Rank ``rank``'s micro-batches: its units ``rank::WORLD`` of each global Poisson draw, in GA parts."""
    sampler = PoissonBatchSampler(len(report["rows"]), report["sample_rate"], steps=report["steps_per_epoch"],
                                  seed=report["seed"], rank=rank, world_size=WORLD)
    batches = []
    for _, units in sampler.draws():
        for part in np.array_split(np.asarray(units, dtype=np.int64), report["micro_batches"]):
            if len(part):
                batches.append([report["rows"][i] for i in part])
    return batches


def test_each_rank_samples_its_own_shard_of_one_poisson_batch(launched):
    reports, _ = launched
    assert [r["world_size"] for r in reports] == [WORLD, WORLD]
    assert reports[0]["seed"] == reports[1]["seed"]  # rank 0's secret seed, broadcast
    # the Trainer's total batch: 2 per device * 2 accumulation * 2 ranks of 32 rows
    assert reports[0]["sample_rate"] == pytest.approx(8 / 32) and reports[0]["steps_per_epoch"] == 4
    for rank, report in enumerate(reports):
        assert report["seen"] == expected_micro_batches(report, rank)  # nothing dealt away, nothing repeated
    seen = [{tuple(row) for batch in r["seen"] for row in batch} for r in reports]
    assert seen[0] and seen[1] and not seen[0] & seen[1]  # a row belongs to one rank only


def test_ranks_agree_and_epsilon_is_logged_once_from_rank_zero(launched):
    reports, stdout = launched
    first, second = reports
    assert first["full"]["params"] == second["full"]["params"]  # one noise draw, all-reduced sums
    assert first["full"]["steps"] == 4 and first["full"]["epsilon"] == second["full"]["epsilon"] > 0
    # 4 step logs and the summary; the resumed run restores the first 2 and logs 3 of its own
    assert len(first["full"]["logged"]) == 5 and first["resumed"]["logged"][:2] == first["full"]["logged"][:2]
    assert stdout.count("'epsilon'") == 5 + 3  # printed by rank 0 only
    assert first["full"]["logged"][-1] == pytest.approx(first["full"]["epsilon"])
    assert first["full"]["tokens"] > 0  # the token count gathered over ranks, empty micro-batches included


def test_resume_reaches_the_same_epsilon_and_parameters(launched):
    reports, _ = launched
    for report in reports:
        full, resumed = report["full"], report["resumed"]
        assert resumed["steps"] == full["steps"] == 4
        assert resumed["epsilon"] == full["epsilon"]
        assert resumed["params"].keys() == full["params"].keys() and full["params"]
        for name, values in full["params"].items():
            assert np.allclose(resumed["params"][name], values, rtol=1e-6, atol=1e-7), name
