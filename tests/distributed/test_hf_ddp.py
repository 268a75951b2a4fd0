"""DPTrainer under ``torchrun --nproc-per-node 2`` (DDP, gloo, CPU): a tiny LoRA Llama, one launch.

The script (``hf_script.py ddp``) trains 4 steps with a checkpoint at step 2, resumes from it in a
second trainer, and trains the first run again with empty micro-batches skipped instead of run as
phantoms; each rank reports what it saw and where it ended.
"""

import numpy as np
import pytest

from dptorch.data.poisson import PoissonBatchSampler
from dptorch.plan import PrivacyPlan
from tests.distributed.launch import WORLD


def expected_micro_batches(report, rank):
    """Rank ``rank``'s micro-batches: its units ``rank::world_size`` of each global Poisson draw, in GA parts."""
    sampler = PoissonBatchSampler(len(report["rows"]), report["sample_rate"], steps=report["steps_per_epoch"],
                                  seed=report["seed"], rank=rank, world_size=report.get("world_size", WORLD))
    return [[report["rows"][i] for i in part] for _, units in sampler.draws()
            for part in np.array_split(np.asarray(units, dtype=np.int64), report["micro_batches"])]


def assert_close_params(got, expected, **tolerance):
    assert got.keys() == expected.keys() and got
    for name, values in expected.items():
        np.testing.assert_allclose(got[name], values, err_msg=name, **tolerance)


def assert_same_run(run, reference):
    """``run`` (a rank's summary) trained ``reference``'s run: its parameters to fp32 rounding of the summation
    order, its losses, epsilon, steps, tokens. The noise moves the LoRA weights by about 0.1 per step here (the
    reference must have moved that far), so an element noised twice or not at all would end far from it."""
    assert_close_params(run["params"], reference["params"], rtol=1e-5, atol=1e-6)
    assert [h["loss"] for h in run["logs"]] == pytest.approx([h["loss"] for h in reference["logs"]], rel=1e-6)
    assert run["epsilon"] == reference["epsilon"] and run["steps"] == reference["steps"] == 4
    assert run["tokens"] == reference["tokens"]
    assert max(abs(v) for values in reference["params"].values() for v in values) > 0.1


def assert_draws_accounted(reports, expected_batch_size):
    """Each rank saw its units of each Poisson draw, every empty micro-batch ran as a phantom, and every draw
    is one accounted step of rate q (the phantoms count nothing)."""
    for rank, report in enumerate(reports):
        full = report["full"]
        assert full["seen"] == expected_micro_batches(report, rank)[:8]
        assert full["phantoms"] == sum(not batch for batch in full["seen"])
    plan = PrivacyPlan(noise_multiplier=reports[0]["noise_multiplier"], sample_rate=reports[0]["sample_rate"],
                       num_units=len(reports[0]["rows"]), accountant="pld")
    for report in reports:
        assert report["full"]["steps"] == 4 and report["full"]["epsilon"] == plan.epsilon_after(4, 1e-3)
        assert report["expected_batch_size"] == report["sample_rate"] * len(report["rows"]) == expected_batch_size


def assert_resumed(report):
    """The run resumed from the sharded checkpoint at step 2 ends where the uninterrupted one ends (the noise
    generator's state travels in dp_privacy_state.pt: with noise_seed, a restarted stream would differ)."""
    assert {"optimizer_0", "pytorch_model_fsdp_0", "dp_privacy_state.pt"} <= set(report["checkpoint"])
    full, resumed = report["full"], report["resumed"]
    assert resumed["steps"] == 4 and resumed["epsilon"] == full["epsilon"]
    assert resumed["logged"][:2] == full["logged"][:2]
    assert_close_params(resumed["params"], full["params"], rtol=0, atol=1e-7)


def test_each_rank_samples_its_own_shard_of_one_poisson_batch(hf_ddp):
    reports, _ = hf_ddp
    assert [r["world_size"] for r in reports] == [WORLD, WORLD]
    assert reports[0]["secret_seed"] == reports[1]["secret_seed"]  # rank 0's secret seed, broadcast
    # the Trainer's total batch: 1 per device * 2 accumulation * 2 ranks of 32 rows
    assert reports[0]["sample_rate"] == pytest.approx(4 / 32) and reports[0]["steps_per_epoch"] == 8
    for rank, report in enumerate(reports):
        assert report["full"]["seen"] == expected_micro_batches(report, rank)[:8]  # nothing dealt away or repeated
    seen = [{tuple(row) for batch in r["full"]["seen"] for row in batch} for r in reports]
    assert seen[0] and seen[1] and not seen[0] & seen[1]  # a row belongs to one rank only


def test_ranks_agree_and_epsilon_is_logged_once_from_rank_zero(hf_ddp):
    reports, stdout = hf_ddp
    first, second = reports
    assert first["full"]["params"] == second["full"]["params"]  # one noise draw, all-reduced sums
    assert first["full"]["steps"] == 4 and first["full"]["epsilon"] == second["full"]["epsilon"] > 0
    # 4 step logs and the summary; the resumed run restores the first 2 and logs 3 of its own
    assert len(first["full"]["logged"]) == 5 and first["resumed"]["logged"][:2] == first["full"]["logged"][:2]
    trl_runs = 5 + 5 if "sft" in first else 0
    # full, resumed, skipping, fp16, seq2seq (SFT, DPO): rank 0 only
    assert stdout.count("'epsilon'") == 5 + 3 + 5 + 5 + 5 + trl_runs
    assert first["full"]["logged"][-1] == pytest.approx(first["full"]["epsilon"])
    # the token count, gathered over the ranks for every micro-batch (0 for an empty one), counts real rows only
    assert first["full"]["tokens"] == sum(len(row) for r in reports for batch in r["full"]["seen"] for row in batch)


def test_resume_reaches_the_same_epsilon_and_parameters(hf_ddp):
    reports, _ = hf_ddp
    for report in reports:
        full, resumed = report["full"], report["resumed"]
        assert resumed["steps"] == full["steps"] == 4
        assert resumed["epsilon"] == full["epsilon"]
        assert_close_params(resumed["params"], full["params"], rtol=1e-6, atol=1e-7)


def test_a_phantom_micro_batch_adds_nothing(hf_ddp):
    """DDP runs no collective per micro-batch, so empty micro-batches may also be skipped: the run with
    phantoms ends bit for bit where the skipping run ends, with the same logged losses and epsilon."""
    reports, _ = hf_ddp
    for report in reports:
        full, skipping = report["full"], report["skipping"]
        assert full["phantoms"] == skipping["phantoms"] == sum(not batch for batch in full["seen"]) > 0
        assert full["params"] == skipping["params"]
        assert [h["loss"] for h in full["logs"]] == [h["loss"] for h in skipping["logs"]]
        assert full["epsilon"] == skipping["epsilon"]
    assert all(batch == [] for batch in (reports[0]["full"]["seen"][1], reports[1]["full"]["seen"][1]))  # both empty


def test_ranks_with_another_per_device_batch_size_are_refused_with_one_message(hf_ddp):
    """Batches of 1 and 2 per device: each rank would plan its own sample rate (the global batch 1 * 2 * 2 or
    2 * 2 * 2 of 32 rows); both ranks refuse when the trainer is built, with the same message, and the launch
    goes on (no rank is left waiting in the gather)."""
    reports, _ = hf_ddp
    messages = [report["disagreeing"] for report in reports]
    assert messages[0] == messages[1]
    assert "sample_rate: 0.125 on rank 0 vs 0.25 on rank 1" in messages[0]
    assert "per_device_train_batch_size" in messages[0]


def test_seq2seq_trains_with_phantoms_and_the_ranks_agree(hf_ddp):
    """private(Seq2SeqTrainer) on a T5 under DDP: one noise draw and all-reduced clipped sums (the same parameters on
    both ranks), every empty micro-batch a phantom, the plan's epsilon for 4 steps."""
    reports, _ = hf_ddp
    first, second = (report["seq2seq"] for report in reports)
    assert first["params"] == second["params"]
    for report in reports:
        run = report["seq2seq"]
        assert run["phantoms"] == run["seen"].count([]) > 0 and run["steps"] == 4
    plan = PrivacyPlan(noise_multiplier=reports[0]["noise_multiplier"], sample_rate=reports[0]["sample_rate"],
                       num_units=len(reports[0]["rows"]), accountant="pld")
    assert first["epsilon"] == second["epsilon"] == plan.epsilon_after(4, 1e-3)
    assert len(first["logs"]) == 4 and all(h["loss"] > 0 for h in first["logs"])


def test_fp16_with_a_dp_grad_scaler_is_the_float32_run_within_float16_rounding(hf_ddp):
    """fp16 on 2 processes: each rank swaps Accelerate's GradScaler for a DPGradScaler, whose scale is a function of
    the step count only (no skip, no data-dependent change), so the ranks agree on it without communicating. The
    forwards ran in float16; the ranks end with the same parameters (one noise draw, all-reduced clipped sums), the
    steps and epsilon of the float32 run, and its parameters within float16 rounding of the update (the bound of
    tests/integrations/test_trainer_fp16.py, 4 u of the largest update element, u = 2^-11)."""
    reports, _ = hf_ddp
    runs = [r["fp16"] for r in reports]
    assert [r["scaler"] for r in runs] == ["DPGradScaler"] * 2 and runs[0]["scale"] == runs[1]["scale"] == 2.0**10
    assert all("torch.float16" in r["dtypes"] for r in runs)
    assert runs[0]["params"] == runs[1]["params"]
    full = reports[0]["full"]
    assert runs[0]["steps"] == full["steps"] == 4 and runs[0]["epsilon"] == full["epsilon"]
    assert runs[0]["seen"] == full["seen"]
    start = runs[0]["start"]
    update = max(abs(v - s) for name in start for v, s in zip(full["params"][name], start[name]))
    assert update > 0.1
    assert_close_params(runs[0]["params"], full["params"], rtol=0, atol=4 * 2.0**-11 * update)
