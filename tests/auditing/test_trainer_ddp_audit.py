"""DPTrainer with PrivacyArguments(audit_canaries=m) under DDP (torchrun, 2 gloo processes): both ranks log the same
audited bounds, hold the same scores (rank 0's canary seed), and the saved model card has the audit subsection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
WORLD, TIMEOUT_S = 2, 240


def _launch(tmp_path_factory, mode: str) -> list:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp(f"trainer-{mode}-audit")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
               str(Path(__file__).with_name("trainer_ddp_script.py")), str(out), mode]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        pytest.fail(f"trainer_ddp_script.py failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return [json.loads((out / f"audit-rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _launch(tmp_path_factory, "ddp")


def test_under_fsdp2_the_canaries_are_drawn_as_under_ddp_and_scored_alike_on_every_rank(ranks, tmp_path_factory):
    """The Trainer attaches the canaries once Accelerate has sharded the parameters (before, FSDP was refused): the
    draws are the DDP run's (rank 0's seed: the same canaries in, the same ones sampled at each step), and the scores,
    each rank's dot products on its shards all-reduced, are the same on both ranks. That each canary is added once
    over the shards is tests/auditing/test_fsdp_audit.py's (the engine's FSDP2 path, which the Trainer's uses)."""
    first, second = _launch(tmp_path_factory, "fsdp")
    assert first["scores"] == second["scores"] and first["audit"] == second["audit"]
    assert max(abs(s) for s in first["scores"]) > 0 and first["audit"]["steps"] == 3
    assert first["times_added"] == second["times_added"] == ranks[0]["times_added"] and sum(first["times_added"]) > 0
    assert first["audit"]["num_included"] == ranks[0]["audit"]["num_included"]


def test_both_ranks_log_and_report_the_same_audit_of_the_same_scores(ranks):
    first, second = ranks
    assert first["seed"] == second["seed"] == 3  # rank 1 was given no audit_seed: rank 0's is the run's
    assert first["scores"] == second["scores"] and max(abs(s) for s in first["scores"]) > 0
    assert [e["step"] for e in first["logged"]] == [1, 2, 3]
    assert all({"epsilon", "audit_epsilon_steinke", "audit_epsilon_fdp"} <= set(e) for e in first["logged"])
    assert first["logged"] == second["logged"] and first["history"] == second["history"]
    assert [a["fdp_epsilon"] for a in first["history"]] == [e["audit_epsilon_fdp"] for e in first["logged"]]
    assert first["audit"] == second["audit"]
    assert first["audit"]["num_canaries"] == 200 and first["audit"]["steps"] == 3 and first["audit"]["consistent"]


def test_the_model_card_saved_by_rank_zero_has_the_audit_subsection(ranks):
    card, audit = ranks[0]["card"], ranks[0]["audit"]
    assert card.count("### Empirical privacy audit") == 1
    assert f"200 dirac gradient canaries in this training run ({audit['num_included']} included" in card
    assert (f"{audit['steinke_epsilon']:.4g} (Steinke" in card and f"{audit['fdp_epsilon']:.4g} (f-DP" in card
            and f"claimed epsilon {audit['claimed_epsilon']:.4g}" in card)
