"""DP-SGD on HSDP: ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh, 2 x 2 processes (gloo).

The clipped sums are reduce-scattered inside each shard group, the ranks of replica 0 add their
shard's noise, and the shards are summed over the replicate group: one draw per element over the
whole mesh, the same gradient on every replica, the update of one process.
"""

import pytest
import torch
import torch.distributed as dist

from dptorch.distributed import ShardedNoise
from dptorch.noise import NoiseGenerator, SecureNoiseGenerator
from tests.distributed import workers

REPLICAS, SHARDS = 2, 2
WORLD = REPLICAS * SHARDS


def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))


def hsdp_scenarios(rank: int):
    yield "hsdp-per-layer-bk", lambda: workers.train(workers.model_like(), "bk", distributed=True, shard="per-layer",
                                                     physical=3, mesh=mesh())
    yield "hsdp-whole-hooks", lambda: workers.train(workers.model_like(), "hooks", distributed=True, shard="whole",
                                                    physical=2, mesh=mesh())
    torch.manual_seed(100 + rank)  # the ranks' own generators differ: the stream must still be rank 0's
    yield "hsdp-noise", lambda: workers.noise_only(
        True, ShardedNoise(NoiseGenerator(seed=workers.NOISE_SEED + rank), chunk_size=workers.CHUNK), mesh=mesh())
    yield "hsdp-noise-secure", lambda: workers.noise_only(True, SecureNoiseGenerator(), mesh=mesh())
    yield "hsdp-resume", lambda: workers.sharded_resume(mesh())
    yield "hand-2d-refused", lambda: workers.sharding_refusal()


@pytest.fixture(scope="module")
def hsdp():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return workers.reader(workers.spawn_all(hsdp_scenarios, world=WORLD))


@pytest.mark.parametrize("name", ["hsdp-per-layer-bk", "hsdp-whole-hooks"])
def test_hsdp_runs_end_where_one_process_ends(hsdp, name):
    mode = name.rsplit("-", 1)[1]
    runs = [hsdp(name, rank) for rank in range(WORLD)]
    for run in runs[1:]:  # every replica and shard ends with the same full parameters
        torch.testing.assert_close(run["params"], runs[0]["params"], rtol=0, atol=0)
    reference = workers.reference(mode)
    torch.testing.assert_close(runs[0]["params"], reference["params"], rtol=1e-5, atol=1e-6)
    assert runs[0]["epsilon"] == pytest.approx(reference["epsilon"], rel=1e-12)
    assert runs[0]["steps"] == reference["steps"]


def test_hsdp_noise_is_one_draw_per_element_over_the_whole_mesh(hsdp):
    runs = [hsdp("hsdp-noise", rank)["draws"] for rank in range(WORLD)]
    expected = workers.reference_noise(
        ShardedNoise(NoiseGenerator(seed=workers.NOISE_SEED), chunk_size=workers.CHUNK))
    for step, reference in enumerate(expected):
        for rank in range(WORLD):  # not doubled by the second replica, not missing on any shard
            torch.testing.assert_close(runs[rank][step]["full"], reference, rtol=1e-6, atol=1e-7)
        for shard in range(SHARDS):  # ranks r and r + SHARDS hold the same shard in the two replicas
            assert torch.equal(runs[shard][step]["local"], runs[shard + SHARDS][step]["local"])


def test_hsdp_secure_noise_has_the_std_of_one_draw_and_is_shared_by_the_replicas(hsdp):
    runs = [hsdp("hsdp-noise-secure", rank)["draws"] for rank in range(WORLD)]
    std = workers.SIGMA * workers.CLIP / workers.BIG_BATCH
    for step in range(workers.BIG_STEPS):
        full = runs[0][step]["full"]
        for rank in range(1, WORLD):
            assert torch.equal(runs[rank][step]["full"], full)
        # 10 100 values: the sample std is within 4 % of the true one with probability > 1 - 1e-8;
        # two replicas' draws summed would give sqrt(2) = 1.41 times it
        assert full.std().item() == pytest.approx(std, rel=0.04)
    assert abs(torch.corrcoef(torch.stack([runs[0][0]["full"], runs[0][1]["full"]]))[0, 1].item()) < 0.06


def test_hsdp_placements_made_by_hand_are_refused(hsdp):
    for rank in range(WORLD):  # (Replicate(), Shard(0)) like HSDP, but nothing gathers the weight for its call
        message = hsdp("hand-2d-refused", rank)
        assert "0: a DTensor parameter on a 2-D mesh" in message and "supported on a 1-D mesh" in message


def test_an_engine_checkpoint_of_an_hsdp_run_resumes_exactly(hsdp):
    for rank in range(WORLD):
        run = hsdp("hsdp-resume", rank)
        torch.testing.assert_close(run["resumed"]["params"], run["first"]["params"], rtol=0, atol=0)
        assert run["resumed"]["epsilon"] == run["first"]["epsilon"] and run["first"]["steps"] > 0
