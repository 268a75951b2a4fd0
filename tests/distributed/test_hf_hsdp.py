"""DPTrainer under HSDP through Accelerate: ``TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...},
parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))`` on 4 processes (gloo, CPU).

Accelerate builds a ``(dp_replicate, dp_shard)`` mesh and hands ``fully_shard`` its 2 x 2 part, so the
LoRA parameters are sharded over 2 ranks and replicated over 2. ``hf_script.py hsdp`` trains the run that
``hf_script.py ddp-only`` trains under DDP on 4 processes (same sampling seed, same noise stream:
``ShardedNoise``), with a sharded checkpoint at step 2 and a resume from it.
"""

from collections import Counter

from tests.distributed.test_hf_ddp import assert_draws_accounted, assert_resumed, assert_same_run

WORLD, SHARDS = 4, 2


def test_accelerate_shards_over_a_2x2_replicate_shard_mesh(hf_hsdp):
    reports, _ = hf_hsdp
    assert [r["world_size"] for r in reports] == [WORLD] * WORLD
    for report in reports:
        for run in (report["full"], report["resumed"]):
            assert run["sharded"] and all(run["sharded"])
            assert run["meshes"] == [[["dp_replicate", "dp_shard_cp"], ["R", "S(0)"], WORLD]]  # (Replicate(), Shard(0))


def test_hsdp_ends_where_ddp_ends(hf_hsdp, hf_ddp4):
    """Same sampling, same noise stream: the same run. An element noised by both replicas, or by neither,
    would end far from the DDP run, where rank 0 draws every element's noise once."""
    hsdp, ddp = hf_hsdp[0], hf_ddp4[0]
    for rank in range(WORLD):
        run = hsdp[rank]["full"]
        assert_same_run(run, ddp[rank]["full"])
        assert run["seen"] == ddp[rank]["full"]["seen"]
        assert run["params"] == hsdp[0]["full"]["params"]  # every replica and shard: one model


def test_phantoms_run_and_each_draw_is_one_accounted_step(hf_hsdp):
    reports, stdout = hf_hsdp
    assert_draws_accounted(reports, expected_batch_size=8)  # rank r: units r::4
    assert all(r["full"]["phantoms"] > 0 for r in reports)
    assert stdout.count("'epsilon'") == 5 + 3  # logged once, from rank 0


def test_clipped_sums_reduce_scatter_in_the_shard_group_and_shards_all_reduce_over_replicas_once_per_step(hf_hsdp):
    """Training's collectives are the same on every rank, call by call and shape by shape (nothing shaped by
    a batch crosses): each backward pass reduce-scatters every full clipped sum into a half (the shard group
    has 2 ranks), and each step all-reduces the rank's noised shards over its replica group once, in one
    tensor of half the trainable elements."""
    reports, _ = hf_hsdp
    runs = [r["full"] for r in reports]
    assert len({tuple(len(b) for b in run["seen"]) for run in runs}) > 1
    assert all(run["collectives"] == runs[0]["collectives"] for run in runs)
    collectives = runs[0]["collectives"]
    counts = Counter(name for name, _ in collectives)
    params = runs[0]["params"]
    assert counts["reduce_scatter_single"] == 8 * len(params)  # 8 backward passes, phantoms included
    for name, shapes in collectives:
        if name == "reduce_scatter_single":
            rows, columns = shapes[1]
            assert shapes[0] == [rows // SHARDS, columns]
    replicas = [shapes for name, shapes in collectives if name == "all_reduce"]
    assert replicas == [[[sum(len(v) for v in params.values()) // SHARDS]]] * 4  # one per step
    assert counts["broadcast_object_list"] == 4  # one noise key per step


def test_resume_from_a_sharded_hsdp_checkpoint(hf_hsdp):
    for report in hf_hsdp[0]:
        assert_resumed(report)
