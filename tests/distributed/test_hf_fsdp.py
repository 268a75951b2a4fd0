"""DPTrainer with FSDP2 through Accelerate (``fsdp_config={"version": 2}``) under ``torchrun --nproc-per-node 2``.

The script (``hf_script.py fsdp``) trains the DDP test's run (same seeds, same noise stream:
``ShardedNoise``) with the LoRA parameters sharded, sharded checkpoints at step 2, and a resume.
Micro-batches that Poisson sampling left empty run as phantoms: FSDP2 all-gathers in every forward
and the clipped sums are reduce-scattered after every backward, so every rank must take part.
``hf_script.py offload`` trains the same DPTrainer run with ``fsdp_config["cpu_offload"] = True``.
"""

from tests.distributed.launch import WORLD
from tests.distributed.test_hf_ddp import assert_draws_accounted, assert_resumed, assert_same_run


def test_the_lora_parameters_are_sharded_and_checkpointed_sharded(hf_fsdp):
    reports, _ = hf_fsdp
    for report in reports:
        sharded = report["full"]["sharded"]
        assert sharded and all(sharded)  # DTensors: Accelerate applied fully_shard
        assert {"optimizer_0", "pytorch_model_fsdp_0", "dp_privacy_state.pt"} <= set(report["checkpoint"])


def test_fsdp2_ends_where_ddp_ends(hf_fsdp, hf_ddp):
    """Same sampling, same noise stream (DDP: rank 0 draws every element's noise once): the same run."""
    fsdp, ddp = hf_fsdp[0], hf_ddp[0]
    for rank in range(WORLD):
        assert_same_run(fsdp[rank]["full"], ddp[rank]["full"])
    assert fsdp[0]["full"]["params"] == fsdp[1]["full"]["params"]  # gathered from the shards: one model


def test_phantoms_run_and_count_nothing(hf_fsdp):
    """Every empty micro-batch ran as a phantom; every Poisson draw is one accounted step of rate q."""
    reports, stdout = hf_fsdp
    assert_draws_accounted(reports, expected_batch_size=4)  # not the phantoms'
    assert all(report["full"]["phantoms"] > 0 for report in reports)
    assert reports[0]["full"]["seen"][0] == []  # rank 0 starts with a phantom, before any real forward
    trl_runs = 5 + 5 if "sft" in reports[0] else 0
    assert stdout.count("'epsilon'") == 5 + 3 + trl_runs  # logged once, from rank 0


def test_resume_from_a_sharded_checkpoint(hf_fsdp):
    for report in hf_fsdp[0]:
        assert_resumed(report)


def test_only_shards_clipped_sums_the_noise_key_and_logged_scalars_cross_ranks(hf_fsdp):
    """The collectives of training (not of checkpointing) are the same on both ranks, call by call and
    shape by shape, although their micro-batches differ in size (and some are phantoms): nothing shaped
    by a batch crosses. They are FSDP2's all-gathers of parameter shards, the reduce-scatters of the
    clipped sums (one per trainable parameter and backward pass, full parameter shape), rank 0's noise
    key, and the scalars the Trainer logs (token count, loss). (DTensor's own functional collectives are
    not ``torch.distributed`` calls and not recorded; in training they only compute the norm of the
    privatised gradient for the logs.)"""
    reports, _ = hf_fsdp
    first, second = (r["full"] for r in reports)
    assert [len(b) for b in first["seen"]] != [len(b) for b in second["seen"]]
    assert first["collectives"] == second["collectives"]
    names = {name for name, _ in first["collectives"]}
    assert names == {"all_gather_single", "reduce_scatter_single", "broadcast_object_list", "all_gather"}
    sizes = {len(values) for values in first["params"].values()}
    for name, shapes in first["collectives"]:
        if name == "reduce_scatter_single":  # (this rank's shard out, the full clipped sum in)
            rows, columns = shapes[1]
            assert rows * columns in sizes and shapes[0] == [rows // WORLD, columns]
        elif name == "all_gather":
            assert all(shape == [1] for shape in shapes)
    backward_passes = 8  # one per micro-batch, phantoms included
    scatters = sum(name == "reduce_scatter_single" for name, _ in first["collectives"])
    assert scatters == backward_passes * len(first["params"])
    assert sum(name == "broadcast_object_list" for name, _ in first["collectives"]) == 4  # one noise key per step


def test_cpu_offloading_through_accelerate_ends_where_fsdp2_ends(hf_offload, hf_fsdp, hf_ddp):
    """``fsdp_config={"version": 2, "cpu_offload": True}``: Accelerate hands ``CPUOffloadPolicy`` to every
    ``fully_shard``, and the DP optimizer's sharded path (clipped sums reduce-scattered where the layer
    computes, each shard then moved to where FSDP2 keeps it, noised and stepped there) trains the FSDP2 run.

    In CPU processes the compute device is the CPU too, so the run equals the FSDP2 run exactly (the same
    arithmetic); it ends where DDP ends to fp32 rounding, with the same collectives as FSDP2 (offloading adds
    none, and nothing shaped by a batch crosses)."""
    offload, fsdp, ddp = hf_offload[0], hf_fsdp[0], hf_ddp[0]
    for rank in range(WORLD):
        run, plain = offload[rank]["full"], fsdp[rank]["full"]
        assert run["offloaded"] and all(run["offloaded"]) and all(run["sharded"])  # every shard lives on the CPU
        assert plain["offloaded"] and not any(plain["offloaded"])
        assert run["params"] == plain["params"]
        assert [h["loss"] for h in run["logs"]] == [h["loss"] for h in plain["logs"]]
        assert_same_run(run, ddp[rank]["full"])
        assert run["epsilon"] == plain["epsilon"] and run["seen"] == plain["seen"]
        assert run["phantoms"] == plain["phantoms"] > 0
        assert run["collectives"] == plain["collectives"]
    assert offload[0]["full"]["params"] == offload[1]["full"]["params"]


def test_resume_from_an_offloaded_sharded_checkpoint(hf_offload):
    reports, stdout = hf_offload
    assert stdout.count("'epsilon'") == 5 + 3  # the full run and the resumed one, logged once, from rank 0
    for report in reports:
        assert report["resumed"]["offloaded"] and all(report["resumed"]["offloaded"])
        assert_resumed(report)
