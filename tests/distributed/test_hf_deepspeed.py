"""DPTrainer with DeepSpeed ZeRO-1, 2 and 3 (``TrainingArguments(deepspeed=config)``) under ``torchrun
--nproc-per-node 2`` (CPU, gloo), against the same private run under DDP.

``hf_deepspeed_script.py`` trains the DDP test's run (``hf_script.py ddp``: same seeds, Poisson draws, noise
stream, gradient accumulation 2 with empty micro-batches) through Accelerate's DeepSpeed engine, with a
DeepSpeed config of the Trainer's ``"auto"`` values; ZeRO-2 and ZeRO-3 checkpoint at step 2 and a second
trainer resumes from each. One launch for every assertion here; the DDP reference is the ``hf_ddp`` launch.
"""

import importlib.util

import pytest

from dptorch.plan import PrivacyPlan
from tests.distributed.launch import WORLD
from tests.distributed.test_hf_ddp import assert_close_params, expected_micro_batches

if importlib.util.find_spec("deepspeed") is None:  # the optional extra: pip install dptorch[deepspeed]
    pytest.skip("deepspeed is not installed", allow_module_level=True)

# plugin: Accelerate's DeepSpeed plugin from the environment, no config
RUNS = ("zero1", "zero2", "zero3", "plugin-zero2")


@pytest.fixture(scope="module")
def hf_deepspeed(tmp_path_factory):
    pytest.importorskip("peft")
    from tests.distributed.launch import torchrun

    reports, _ = torchrun("hf_deepspeed_script.py", tmp_path_factory.mktemp("hf-deepspeed"), reports="hf-deepspeed")
    return reports


@pytest.mark.parametrize("run", RUNS)
def test_zero_ends_where_ddp_ends(hf_deepspeed, hf_ddp, run):
    """Same sampling, same noise: the parameters DDP reaches, to fp32 rounding (ZeRO averages the ranks' identical
    noised gradients and steps its fp32 master partitions); the same logged losses, epsilon and token count."""
    ddp = hf_ddp[0]
    for rank in range(WORLD):
        got, expected = hf_deepspeed[rank][run], ddp[rank]["full"]
        assert_close_params(got["params"], expected["params"], rtol=1e-5, atol=1e-6)
        assert [h["loss"] for h in got["logs"]] == pytest.approx([h["loss"] for h in expected["logs"]], rel=1e-6)
        assert got["epsilon"] == expected["epsilon"] and got["tokens"] == expected["tokens"]
    assert hf_deepspeed[0][run]["params"] == hf_deepspeed[1][run]["params"]
    moved = max(abs(v) for values in ddp[0]["full"]["params"].values() for v in values)
    assert moved > 0.1  # the noise and the updates moved the LoRA weights: the comparison means something


@pytest.mark.parametrize("run", RUNS + ("zero2-bf16", "zero3-bf16"))
def test_one_epsilon_the_accountants_and_one_deepspeed_step_per_logical_batch(hf_deepspeed, run):
    report = hf_deepspeed[0]
    plan = PrivacyPlan(noise_multiplier=report["noise_multiplier"], sample_rate=report["sample_rate"],
                       num_units=len(report["rows"]), accountant="pld")
    for rank in hf_deepspeed:
        assert rank[run]["steps"] == 4 and rank[run]["epsilon"] == plan.epsilon_after(4, 1e-3)
        # DeepSpeed counts no micro-batches of its own: it stepped once per logical batch (2 micro-batches)
        assert rank[run]["ds_accumulation"] == 1 and rank[run]["global_steps"] == 4


@pytest.mark.parametrize("run", RUNS)
def test_empty_micro_batches_run_as_phantoms(hf_deepspeed, run):
    """Each rank's micro-batches are its share of the Poisson draws; every empty one ran as a phantom (its
    backward reaches the engine, whose step Accelerate calls after the last micro-batch of a step)."""
    for rank, report in enumerate(hf_deepspeed):
        seen = report[run]["seen"]
        assert seen == expected_micro_batches(report, rank)[:8]
        assert report[run]["phantoms"] == sum(not batch for batch in seen) > 0
    assert hf_deepspeed[1][run]["seen"][4] == hf_deepspeed[1][run]["seen"][5] == []  # a whole step empty on rank 1


def test_a_model_built_partitioned_under_zero3_trains_as_one_built_whole(hf_deepspeed):
    """Built after the TrainingArguments, the model comes partitioned (deepspeed.zero.Init: its base parameters
    empty when the trainer and its controller are built): the run is the zero3 run, bit for bit."""
    for report in hf_deepspeed:
        init, whole = report["zero3-init"], report["zero3"]
        assert init["partitioned"] and init["zero_stage"] == 3
        assert init["params"] == whole["params"] and init["logged"] == whole["logged"]
        assert init["epsilon"] == whole["epsilon"] and init["global_steps"] == whole["global_steps"] == 4


def test_accelerates_plugin_is_zero2(hf_deepspeed):
    assert [report["plugin-zero2"]["zero_stage"] for report in hf_deepspeed] == [2] * WORLD


def test_privacy_units_under_zero1_as_under_ddp(hf_deepspeed):
    """Two rows per unit (``privacy_unit_column``): ZeRO-1 ends where DDP with the same units ends, at the same
    epsilon; units sampled whole (micro-batches of 2 and 4 rows, or empty)."""
    for report in hf_deepspeed:
        zero, ddp = report["units-zero1"], report["units-ddp"]
        assert_close_params(zero["params"], ddp["params"], rtol=1e-5, atol=1e-6)
        assert zero["epsilon"] == ddp["epsilon"] and zero["steps"] == ddp["steps"] == 4
        assert {len(batch) for batch in zero["seen"]} <= {0, 2, 4} and zero["phantoms"] > 0
        assert zero["params"] != report["zero1"]["params"]  # the units changed the run


@pytest.mark.parametrize("run, resumed_run, checkpoint", [("zero2", "resumed", "checkpoint"),
                                                          ("zero3", "resumed-zero3", "checkpoint-zero3")])
def test_resume_from_a_deepspeed_checkpoint(hf_deepspeed, run, resumed_run, checkpoint):
    """DeepSpeed saves and loads its partitioned state; the privacy state and the noise generator travel in
    dp_privacy_state.pt: the resumed run ends where the uninterrupted one ends."""
    for report in hf_deepspeed:
        assert {"global_step2", "dp_privacy_state.pt"} <= set(report[checkpoint])
        full, resumed = report[run], report[resumed_run]
        assert resumed["steps"] == 4 and resumed["epsilon"] == full["epsilon"] and resumed["global_steps"] == 4
        assert resumed["logged"][:2] == full["logged"][:2]
        assert_close_params(resumed["params"], full["params"], rtol=0, atol=1e-7)


@pytest.mark.parametrize("run", ["zero2-bf16", "zero3-bf16"])
def test_bf16_zero_ends_where_fp32_ddp_ends_to_bf16_rounding(hf_deepspeed, hf_ddp, run):
    """bf16=True: DeepSpeed casts the model to bf16 and keeps fp32 master weights; the same run to bf16 rounding."""
    for rank in range(WORLD):
        got, expected = hf_deepspeed[rank][run], hf_ddp[0][rank]["full"]
        assert got["dtype"] == "torch.bfloat16"
        largest = max(abs(v) for values in expected["params"].values() for v in values)
        assert_close_params(got["params"], expected["params"], rtol=0, atol=4 * 2**-8 * largest)
    assert hf_deepspeed[0][run]["params"] == hf_deepspeed[1][run]["params"]


@pytest.mark.parametrize("name, words", [
    ("refused-zero3-granularity", ["stage3_module_granularity_threshold", "leaf modules", "remove it"]),
    ("refused-stage0", ["ZeRO stage 0", "DDP"]),
    ("refused-clipping", ['"gradient_clipping" is 1.0', "noised gradient", '"gradient_clipping": "auto" or 0']),
    ("refused-offload", ["offload_optimizer", "remove the offload"]),
    ("refused-fp16", ["fp16", "bf16=True"]),
])
def test_unsupported_set_ups_are_refused_at_construction_on_every_rank(hf_deepspeed, name, words):
    for report in hf_deepspeed:
        assert report[name].startswith("cannot train privately"), report[name]
        assert all(word in report[name] for word in words), report[name]


def test_gradient_clipping_auto_is_the_private_trainer_s_per_sample_clipping(hf_deepspeed):
    """HF's documented DeepSpeed configs write "auto" and max_grad_norm defaults to 1.0: DeepSpeed's clipping becomes 0
    (max_grad_norm is ignored as under DDP) and the run is the max_grad_norm=0 run, step for step."""
    for report in hf_deepspeed:
        got, expected = report["auto-clipping"], report["zero2"]
        assert got["clipping"] == 0 and got["global_steps"] == expected["global_steps"]
        assert got["logged"] == expected["logged"]
        assert_close_params(got["params"], expected["params"], rtol=0, atol=0)


def test_a_zero3_full_fine_tune_ends_where_the_ddp_full_fine_tune_ends(hf_deepspeed):
    """Full fine-tuning (the embedding, the RMSNorms and every Linear train; their samplers run while ZeRO-3 has the
    parameters released and read shapes from ds_shape): the DDP run's parameters to fp32 rounding, the same losses,
    epsilon, tokens and steps."""
    for report in hf_deepspeed:
        got, expected = report["zero3-full"], report["ddp-full"]
        assert got["zero_stage"] == 3 and got["global_steps"] == 4
        assert "model.embed_tokens.weight" in got["params"] and "model.norm.weight" in got["params"]
        assert_close_params(got["params"], expected["params"], rtol=1e-5, atol=1e-6)
        assert [h["loss"] for h in got["logs"]] == pytest.approx([h["loss"] for h in expected["logs"]], rel=1e-6)
        assert got["epsilon"] == expected["epsilon"] and got["tokens"] == expected["tokens"]
    assert hf_deepspeed[0]["zero3-full"]["params"] == hf_deepspeed[1]["zero3-full"]["params"]


def test_a_second_train_of_a_deepspeed_trainer_is_refused(hf_deepspeed):
    """Accelerate would not prepare the first train()'s engine again, and a new DP optimizer would replay the noise
    stream of noise_seed: refused before anything runs, naming the fix."""
    for report in hf_deepspeed:
        message = report["refused-second-train"]
        assert "second train()" in message and "resume_from_checkpoint" in message, message
