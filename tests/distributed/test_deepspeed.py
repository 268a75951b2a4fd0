"""DP-SGD under DeepSpeed ZeRO stages 1, 2 and 3 (CPU, gloo, 2 processes), against one process.

``deepspeed_script.py`` trains through DeepSpeed's own loop (``engine(x)``, ``engine.backward(loss)``,
``engine.step()``) on the same Poisson batches and the same noise stream as the one-process
references of ``workers``; the clipped sums are reduce-scattered into ZeRO's partitions after every backward
pass, each rank's partition of the noised gradient is handed to ZeRO (ZeRO-1/2: its ``averaged_gradients``;
ZeRO-3: its gradient partitions), and DeepSpeed steps its partitioned fp32 master weights with it. ZeRO-3 runs
with every parameter released outside its module's calls.
"""

import importlib.util

import pytest
import torch

from tests.distributed import workers
from tests.distributed.workers import WORLD

if importlib.util.find_spec("deepspeed") is None:  # the optional extra: pip install dptorch[deepspeed]
    pytest.skip("deepspeed is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.distributed.launch import torchrun

    reports, _ = torchrun("deepspeed_script.py", tmp_path_factory.mktemp("deepspeed"), reports="deepspeed")
    return reports


@pytest.mark.parametrize("name, mode", [("zero1-hooks", "hooks"), ("zero2-bk", "bk"), ("zero1-hooks-buckets", "hooks"),
                                        ("zero2-bk-round-robin", "bk"), ("zero3-hooks", "hooks"),
                                        ("zero3-bk", "bk"), ("zero3-ghost", "ghost")])
def test_zero_ends_where_one_process_ends(ranks, name, mode):
    """Same logical batches, same noise: every rank's weights equal the one-process run's to fp32 rounding."""
    reference = workers.reference(mode)
    runs = [torch.tensor(rank[name]["params"]) for rank in ranks]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    torch.testing.assert_close(runs[0], reference["params"], rtol=1e-5, atol=1e-6)
    start = workers.flat_params(workers.model_like())
    assert (reference["params"] - start).abs().max() > 1e-2  # the runs moved: the comparison means something


@pytest.mark.parametrize("name, mode", [("zero1-bf16-hooks", "hooks"), ("zero2-bf16-bk", "bk"),
                                        ("zero2-bf16-fp32-accumulation-bk", "bk"), ("zero3-bf16-bk", "bk")])
def test_bf16_zero_ends_where_one_fp32_process_ends_to_bf16_rounding(ranks, name, mode):
    """DeepSpeed's bf16 (the model cast to bf16, fp32 master weights; ZeRO-2 also with fp32 gradient accumulation):
    the same update to bf16 rounding."""
    reference = workers.reference(mode)["params"]
    runs = [torch.tensor(rank[name]["params"]) for rank in ranks]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    # the weights are read back in bf16 (8 significant bits): a few units of 2**-8 of their size
    torch.testing.assert_close(runs[0], reference, rtol=0, atol=4 * 2**-8 * reference.abs().max().item())
    assert [rank[name]["global_steps"] for rank in ranks] == [3] * WORLD


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_zero3_full_fine_tune_of_a_llama_ends_where_one_process_ends(ranks, mode):
    """A full fine-tune of a tiny Llama (its nn.Embedding, LlamaRMSNorm and nn.Linear layers all train, every
    parameter released when the samplers run, which read shapes from ZeRO-3's ds_shape): one process's weights."""
    from tests.distributed.deepspeed_script import TinyLlama

    name = f"zero3-llama-{mode}"
    reference = workers.reference(mode, model=TinyLlama)
    runs = [torch.tensor(rank[name]["params"]) for rank in ranks]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    torch.testing.assert_close(runs[0], reference["params"], rtol=1e-5, atol=1e-6)
    assert [rank[name]["whole"] for rank in ranks] == [0] * WORLD
    assert [rank[name]["steps"] for rank in ranks] == [reference["steps"]] * WORLD == [3] * WORLD
    start = workers.flat_params(TinyLlama())
    embedding = TinyLlama().llama.model.embed_tokens.weight.numel()  # the first parameters: the embedding moved
    assert (reference["params"][:embedding] - start[:embedding]).abs().max() > 1e-2


def test_zero3_runs_with_released_parameters_and_empty_micro_batches(ranks):
    """Outside its module's calls every ZeRO-3 parameter is released to its partitions (the samplers ran on
    released parameters), and the ranks ran their empty physical batches' forwards and backwards (ZeRO-3 gathers
    in both, so every rank must): the runs above still end where one process ends (zero3-hooks reduce-scatters
    its clipped sums in buckets of one or two parameters, the others in one)."""
    for name in ("zero3-hooks", "zero3-bk", "zero3-bf16-bk"):
        assert [rank[name]["whole"] for rank in ranks] == [0] * WORLD
    assert sum(rank["zero3-hooks"]["empty"] for rank in ranks) > 0


@pytest.mark.parametrize("name, writer", [
    ("zero1-hooks", "Zero12Partitions"), ("zero2-bk", "Zero12Partitions"), ("zero2-bf16-bk", "Zero12Partitions"),
    ("zero1-bf16-hooks", "Zero12Partitions"), ("zero2-bf16-fp32-accumulation-bk", "Zero12Partitions"),
    ("zero1-hooks-buckets", "Zero12Partitions"), ("zero2-bk-round-robin", "Zero12Partitions"),
    ("zero3-hooks", "Zero3Partitions"), ("zero3-bk", "Zero3Partitions"), ("zero3-bf16-bk", "Zero3Partitions"),
    ("zero3-llama-hooks", "Zero3Partitions"), ("zero3-llama-bk", "Zero3Partitions")])
def test_each_rank_holds_only_its_partition_of_the_clipped_sums_between_micro_batches(ranks, name, writer):
    """The clipped sums are reduce-scattered at the end of every backward pass: between the micro-batches of a step
    (physical batches of 1 or 3, phantoms for the Llama) each rank holds exactly the elements of the trainable
    parameters that lie in its ZeRO partitions (DeepSpeed's own count: ZeRO-1/2's partition sizes less their
    padding, ZeRO-3's partitions less the last rank's padding), each element on one rank only, never a full-size
    sum; the runs above still end where one process ends. The writer is the optimizer's own seam, not a method
    replaced on the instance."""
    for rank in ranks:
        kept = rank[name]["kept"]
        assert kept["max_held"] == kept["owned"] > 0
        assert kept["writer"] == writer and not kept["add_noise_replaced"]
    assert sum(rank[name]["kept"]["max_held"] for rank in ranks) == sum(ranks[0][name]["kept"]["numels"])


@pytest.mark.parametrize("name, mode", [("zero1-hooks", "hooks"), ("zero2-bk", "bk"), ("zero2-bf16-bk", "bk"),
                                        ("zero3-hooks", "hooks"), ("zero3-bk", "bk"), ("zero3-bf16-bk", "bk")])
def test_one_epsilon_on_every_rank_and_deepspeed_steps_only_on_private_steps(ranks, name, mode):
    reference = workers.reference(mode)
    assert [rank[name]["steps"] for rank in ranks] == [reference["steps"]] * WORLD == [3] * WORLD
    assert ranks[0][name]["epsilon"] == ranks[1][name]["epsilon"] == pytest.approx(reference["epsilon"], rel=1e-12)
    # the virtual steps of BatchMemoryManager (physical batches of 1) never reached DeepSpeed's step
    assert [rank[name]["global_steps"] for rank in ranks] == [3] * WORLD
    # an engine checkpoint would miss DeepSpeed's partitioned state: refused, not written half
    assert all("engine.save_checkpoint" in rank[name]["checkpoint"] for rank in ranks)


def test_make_private_with_epsilon_takes_a_deepspeed_engine(ranks):
    runs = [rank["zero1-with-epsilon"] for rank in ranks]
    assert all(run["same_engine"] for run in runs)
    assert runs[0]["epsilon"] == runs[1]["epsilon"] <= 5.0 + 1e-9
    assert runs[0]["steps"] == runs[0]["global_steps"] == runs[1]["global_steps"] > 0


@pytest.mark.parametrize("name", ["noise-zero2", "noise-zero3"])
def test_noise_is_drawn_once_per_element_across_the_ranks(ranks, name):
    """Updates of a zero loss are the noise / E[B]: one process's stream exactly, std sigma C / E[B], not sqrt(2) times
    (ZeRO-3: each rank draws only its partition's slice of the stream)."""
    from dptorch.distributed import ShardedNoise

    expected = workers.reference_noise(ShardedNoise(seed=workers.NOISE_SEED))
    runs = [[torch.tensor(step) for step in rank[name]] for rank in ranks]
    for step, reference in enumerate(expected):
        torch.testing.assert_close(runs[0][step], runs[1][step], rtol=0, atol=0)
        torch.testing.assert_close(runs[0][step], reference, rtol=1e-5, atol=1e-7)
    noise = torch.cat(runs[0])
    assert noise.std().item() == pytest.approx(workers.SIGMA * workers.CLIP / workers.BIG_BATCH, rel=0.04)


def test_secure_noise_under_zero3_is_each_ranks_own_partition_draw(ranks):
    """secure_mode: each rank draws its partition's slice from its own OS-seeded stream; the gathered updates are the
    same on both ranks, of std sigma C / E[B] (once per element), and not the seeded stream."""
    runs = [torch.cat([torch.tensor(step) for step in rank["noise-zero3-secure"]]) for rank in ranks]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    assert runs[0].std().item() == pytest.approx(workers.SIGMA * workers.CLIP / workers.BIG_BATCH, rel=0.04)
    assert not torch.equal(runs[0], torch.cat([torch.tensor(step) for step in ranks[0]["noise-zero3"]]))


@pytest.mark.parametrize("name, words", [
    ("refused-clipping", ['"gradient_clipping": 1.0', "noised gradient", '"gradient_clipping": 0']),
    ("refused-accumulation", ['"gradient_accumulation_steps": 2', "BatchMemoryManager"]),
    ("refused-zero3-no-sampler", ["ZeRO-3", "1 (Scale) has no grad sampler", "released", "ZeRO stage 1 or 2"]),
    ("refused-zero3-conv", ["ZeRO-3", "0 (Conv1d)", "released", "nn.Embedding"]),
    ("refused-zero3-functorch", ['grad_sample_mode="functorch"', "released", '"hooks", "bk" or "ghost"']),
    ("refused-zero3-leaf", ["leaf modules", "set_z3_leaf_modules"]),
    ("refused-zero3-bandmf", ["bandmf", "partition", "noise_mechanism='independent'"]),
    ("refused-zero2-bandmf", ["ZeRO-2", "bandmf", "partition", "noise_mechanism='independent'"]),
    ("refused-stage0", ["ZeRO stage 0", "DistributedDataParallel"]),
    ("refused-offload", ["offload_optimizer", "remove the offload"]),
    ("refused-client-optimizer", ["engine.optimizer", "got SGD"]),
])
def test_unsupported_set_ups_are_refused_before_any_step_on_every_rank(ranks, name, words):
    for rank in ranks:
        assert all(word in rank[name] for word in words), rank[name]


@pytest.mark.parametrize("name", ["unseen-zero2", "unseen-zero3"])
def test_a_path_the_controller_does_not_see_is_refused_and_never_reaches_zero(ranks, name):
    """The weight read outside its layer: refused on every rank, and its raw gradient is in no ZeRO bucket
    (ZeRO's gradient hooks are off while the engine is private), so no later step can add it."""
    for rank in ranks:
        seen = rank[name]
        assert "lin.weight" in seen["error"] and "path outside" in seen["error"]
        assert seen["reduced_by_deepspeed"] == 0


def test_detach_gives_zero3_its_own_gradient_handling_back(ranks):
    """After a private step and detach, a plain DeepSpeed step is ZeRO-3's: the ranks' average gradient of the
    whole dataset's sum loss (each rank its half), stepped at lr 0.5 from the same weights on every rank."""
    before = torch.tensor(ranks[0]["after-detach-zero3"]["before"])
    model = workers.model_like()
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(before, model.parameters())
    x, y = workers.dataset().tensors
    ((model(x) - y) ** 2).sum().backward()
    expected = before - 0.5 * torch.cat([p.grad.flatten() for p in model.parameters()]) / WORLD
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["after-detach-zero3"]["before"]), before, rtol=0, atol=0)
        torch.testing.assert_close(torch.tensor(rank["after-detach-zero3"]["after"]), expected, rtol=1e-5, atol=1e-6)
