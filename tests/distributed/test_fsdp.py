"""DP-SGD on FSDP2 (``fully_shard``, per layer and whole model; gloo, 2 processes).

Per-sample norms are complete on the rank that holds the sample (its forward and backward use the
gathered layers); the clipped sums are reduce-scattered after every backward and stay sharded;
each rank adds its shard's slice of one global noise stream (``ShardedNoise``).
"""

import pytest
import torch

from dptorch.distributed import ShardedNoise
from dptorch.noise import NoiseGenerator
from tests.distributed import workers
from tests.distributed.workers import WORLD


@pytest.fixture(scope="module")
def references():
    return {mode: workers.reference(mode) for mode in ("hooks", "bk")}


@pytest.mark.parametrize("name", ["fsdp-per-layer-hooks", "fsdp-per-layer-bk", "fsdp-whole-bk", "fsdp-offload-bk"])
def test_sharded_runs_end_where_one_process_ends(result, references, name):
    mode = name.rsplit("-", 1)[1]
    runs = [result(name, rank) for rank in range(WORLD)]
    torch.testing.assert_close(runs[0]["params"], runs[1]["params"], rtol=0, atol=0)
    torch.testing.assert_close(runs[0]["params"], references[mode]["params"], rtol=1e-5, atol=1e-6)
    assert runs[0]["epsilon"] == pytest.approx(references[mode]["epsilon"], rel=1e-12)


def test_activation_checkpointing_and_bf16_parameters(result):
    """Checkpointed blocks (non-reentrant), fp32: exact; with bf16 gathered parameters: close to fp32."""
    reference = workers.reference("bk", workers.blocks_like)  # no checkpointing, no sharding, fp32
    moved = (reference["params"] - workers.flat_params(workers.blocks_like())).abs().max()
    for name, tolerance in (("fsdp-checkpointed-bk", 1e-6), ("fsdp-bf16-checkpointed-hooks", 2e-2 * moved)):
        runs = [result(name, rank) for rank in range(WORLD)]
        torch.testing.assert_close(runs[0]["params"], runs[1]["params"], rtol=0, atol=0)
        torch.testing.assert_close(runs[0]["params"], reference["params"], rtol=0, atol=float(tolerance))


def test_one_noise_draw_per_element_across_the_shards(result):
    runs = [result("noise-fsdp", rank)["draws"] for rank in range(WORLD)]
    # the ranks' generators were seeded differently: the stream is rank 0's, as in one process
    expected = workers.reference_noise(
        ShardedNoise(NoiseGenerator(seed=workers.NOISE_SEED), chunk_size=workers.CHUNK))
    std = workers.SIGMA * workers.CLIP / workers.BIG_BATCH
    for step, reference in enumerate(expected):
        torch.testing.assert_close(runs[0][step]["full"], reference, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(runs[1][step]["full"], reference, rtol=1e-6, atol=1e-7)
        first, second = runs[0][step]["local"], runs[1][step]["local"]
        assert first.numel() + second.numel() == reference.numel()  # neither missing nor repeated elements
        for shard in (first, second):  # each shard got its own full-strength draw ...
            assert shard.std().item() == pytest.approx(std, rel=0.06)
        k = min(first.numel(), second.numel())
        assert abs(torch.corrcoef(torch.stack([first[:k], second[:k]]))[0, 1].item()) < 0.06  # ... not a copy
    noise = torch.cat([step["full"] for step in runs[0]])
    assert noise.std().item() == pytest.approx(std, rel=0.04)  # not sqrt(WORLD) times it, not less
    # steps differ: a fresh draw per step
    assert abs(torch.corrcoef(torch.stack([runs[0][0]["full"], runs[0][1]["full"]]))[0, 1].item()) < 0.06


def test_a_plain_noise_generator_is_drawn_per_element_under_fsdp(result):
    """The engine's default NoiseGenerator is used as ShardedNoise's base: rank 0's stream, sliced."""
    expected = workers.reference_noise(ShardedNoise(NoiseGenerator(seed=workers.NOISE_SEED)))
    for rank in range(WORLD):
        for step, reference in enumerate(expected):
            full = result("noise-fsdp-plain-generator", rank)["draws"][step]["full"]
            torch.testing.assert_close(full, reference, rtol=1e-6, atol=1e-7)


def test_sharded_noise_does_not_depend_on_the_cut():
    noise = ShardedNoise(seed=3, chunk_size=7)
    key = noise.step_key()
    whole = noise.slice(key, 4, 50, 0, 50, 1.0)
    pieces = torch.cat([noise.slice(key, 4, 50, a, b, 1.0) for a, b in ((0, 13), (13, 14), (14, 14), (14, 50))])
    torch.testing.assert_close(pieces, whole, rtol=0, atol=0)
    assert not torch.equal(noise.slice(key, 5, 50, 0, 50, 1.0), whole)  # another parameter, other values
    assert not torch.equal(noise.slice(noise.step_key(), 4, 50, 0, 50, 1.0), whole)  # another step, too


def test_an_engine_checkpoint_of_a_sharded_run_resumes_exactly(result):
    """save_checkpoint writes a directory (DCP shards + rank 0's privacy state); a fresh run with other
    initial weights, resumed from it, takes the same second epoch: parameters, momentum, sampler, noise."""
    for rank in range(WORLD):
        run = result("fsdp-resume", rank)
        torch.testing.assert_close(run["resumed"]["params"], run["first"]["params"], rtol=0, atol=0)
        assert run["resumed"]["epsilon"] == run["first"]["epsilon"] and run["resumed"]["steps"] == run["first"]["steps"]
        assert run["first"]["steps"] > 0
        assert "clipped gradients are held for the next step" in run["mid_step"]
