"""DP-SGD over torch.distributed (gloo, 2 processes on loopback): engine, DDP, BatchMemoryManager.

Each rank samples its shard of one Poisson batch with the global rate q; the DP optimizer adds up
the clipped sums of all ranks and draws the noise once, on rank 0. DDP's own all-reduce of the raw
gradients is switched off during a private forward, so the controller keeps the layers' own
parameters out of autograd as on one process, and refuses a gradient by a path it does not see.
"""

import pytest
import torch

from tests.distributed import workers
from tests.distributed.workers import WORLD


@pytest.fixture(scope="module")
def reference_hooks():
    return workers.reference("hooks")


@pytest.mark.parametrize("name", ["allreduce-hooks", "ddp-hooks", "ddp-bk"])
def test_two_processes_end_where_one_process_ends(result, reference_hooks, name):
    """Same logical batches (the same sampling seed), same noise stream, same parameters and epsilon."""
    runs = [result(name, rank) for rank in range(WORLD)]
    torch.testing.assert_close(runs[0]["params"], runs[1]["params"], rtol=0, atol=0)
    torch.testing.assert_close(runs[0]["params"], reference_hooks["params"], rtol=1e-5, atol=1e-6)
    start = workers.flat_params(workers.model_like())
    assert (reference_hooks["params"] - start).abs().max() > 1e-2  # the runs moved: the comparison means something


def test_fp16_with_a_dp_grad_scaler_under_ddp_is_the_float32_run_within_float16_rounding(result, reference_hooks):
    """CPU float16 autocast, a fixed DPGradScaler (the same schedule on every rank: a function of the step
    count): both ranks end equal, and within 4u (u = 2^-11) of the one-process float32 run, relative to how far
    that run moved (3 steps; the float32 noise is the same draw)."""
    runs = [result("ddp-fp16-bk", rank) for rank in range(WORLD)]
    torch.testing.assert_close(runs[0]["params"], runs[1]["params"], rtol=0, atol=0)
    start = workers.flat_params(workers.model_like())
    moved = reference_hooks["params"] - start
    error = (runs[0]["params"] - reference_hooks["params"]).norm() / moved.norm()
    assert 0 < float(error) <= 4 * 2.0**-11  # not bit-equal: the forward really ran in float16
    assert runs[0]["epsilon"] == pytest.approx(reference_hooks["epsilon"], rel=1e-12)


@pytest.mark.parametrize("name", ["ddp-hooks", "fsdp-whole-bk"])
def test_each_step_is_accounted_once_with_the_global_sample_rate(result, reference_hooks, name):
    runs = [result(name, rank) for rank in range(WORLD)]
    assert [r["steps"] for r in runs] == [reference_hooks["steps"]] * WORLD == [3] * WORLD  # not 3 * WORLD
    assert runs[0]["epsilon"] == runs[1]["epsilon"] == pytest.approx(reference_hooks["epsilon"], rel=1e-12)
    # the ranks' shards add up to the one-process logical batches, step by step
    assert [sum(r) for r in zip(*(run["rows_per_step"] for run in runs))] == reference_hooks["rows_per_step"]


def test_batch_memory_manager_gives_every_rank_the_same_number_of_physical_batches(result):
    runs = [result("ddp-hooks", rank) for rank in range(WORLD)]
    counts = [run["physical_per_step"] for run in runs]
    assert counts[0] == counts[1]
    # physical batches of 1: without padding a rank would run max(1, its rows) of them
    unpadded = [[max(1, rows) for rows in run["rows_per_step"]] for run in runs]
    assert counts[0] == [max(column) for column in zip(*unpadded)]
    assert unpadded[0] != unpadded[1]  # the ranks did draw different numbers: padding was needed


def test_noise_is_drawn_once_on_rank_zero_for_ddp(result):
    from dptorch.noise import NoiseGenerator

    runs = [result("noise-ddp", rank)["draws"] for rank in range(WORLD)]
    expected = workers.reference_noise(NoiseGenerator(seed=workers.NOISE_SEED))  # rank 0's generator alone
    for step, reference in enumerate(expected):
        torch.testing.assert_close(runs[0][step]["full"], runs[1][step]["full"], rtol=0, atol=0)
        torch.testing.assert_close(runs[0][step]["full"], reference, rtol=1e-6, atol=1e-7)
    noise = torch.cat([step["full"] for step in runs[0]])
    assert noise.std().item() == pytest.approx(workers.SIGMA * workers.CLIP / workers.BIG_BATCH, rel=0.04)


def test_unseen_path_is_refused_under_ddp(result):
    for rank in range(WORLD):
        message = result("unseen-ddp", rank)
        assert "lin.weight" in message and "path outside" in message


def test_ddp_sync_is_off_only_inside_a_private_forward(result):
    for rank in range(WORLD):
        seen = result("ddp-sync", rank)
        assert seen["inside"] == [False, True]  # the private forward; then plain DDP after cleanup
        assert seen["after"] is True and seen["plain_grad"] and seen["hooks_left"] == 0


def test_ranks_may_skip_different_forwards(result):
    """No collective in a private DDP forward (no gradient all-reduce, no buffer broadcast)."""
    torch.testing.assert_close(result("ddp-uneven-forwards", 0), result("ddp-uneven-forwards", 1), rtol=0, atol=0)
