"""Distributed pieces that need no second process: padding plans, shard sampling, Trainer refusals."""

from types import SimpleNamespace

import pytest
import torch

from dptorch.data.memory_manager import agreed_counts, pad_physical_plan
from dptorch.distributed.ddp import ddp_wrappers, keep_out_of_gradient_sync


def test_padding_keeps_the_closing_batch_last_and_adds_only_empty_ones():
    plan = pad_physical_plan([[1, 2, 3], [], [4]], [3, 2, 1], max_physical_batch_size=2)
    assert plan == [([1, 2], False), ([3], False), ([], True), ([], False), ([], True), ([4], True)]
    with pytest.raises(ValueError):
        pad_physical_plan([[1, 2, 3]], [1], max_physical_batch_size=2)
    assert agreed_counts([2, 1]) == [2, 1]  # no process group: nothing to agree on


def test_trainer_sampler_deals_each_rank_its_own_units():
    pytest.importorskip("transformers")
    from dptorch.integrations.hf import PoissonMicroBatchSampler, PrivacyUnits, SamplingPlan

    plan = SamplingPlan.for_training(num_units=64, batch_size=2, gradient_accumulation_steps=2, max_steps=0,
                                     num_train_epochs=1, world_size=4)
    assert plan.sample_rate == pytest.approx(16 / 64) and plan.steps_per_epoch == 4 and plan.micro_batches == 2
    units = PrivacyUnits.from_dataset(list(range(64)), None)
    samplers = [PoissonMicroBatchSampler(units, plan.sample_rate, steps=4, micro_batches=2, seed=3, rank=r,
                                         world_size=4) for r in range(4)]
    whole = PoissonMicroBatchSampler(units, plan.sample_rate, steps=4, micro_batches=1, seed=3)
    per_rank = [list(s) for s in samplers]
    assert all(len(batches) == 8 for batches in per_rank)  # the same number of micro-batches everywhere
    for step, draw in enumerate(whole):
        got = sorted(i for r in range(4) for mb in per_rank[r][2 * step:2 * step + 2] for i in mb)
        assert got == sorted(draw)  # the ranks' parts add up to one Poisson draw, nothing repeated
        for r in range(4):
            assert all(i % 4 == r for mb in per_rank[r][2 * step:2 * step + 2] for i in mb)


def fake_trainer(**args):
    defaults = dict(world_size=1, n_gpu=1, fp16=False, optim="sgd", auto_find_batch_size=False,
                    neftune_noise_alpha=None, use_liger_kernel=False, torch_compile=False, ignore_data_skip=False,
                    train_sampling_strategy="random", save_only_model=False, parallelism_config=None)
    defaults.update(args)
    return SimpleNamespace(args=SimpleNamespace(**defaults), train_dataset=[1, 2, 3], model_init=None, model=None,
                           is_deepspeed_enabled=False, is_fsdp_enabled=False)


def test_trainer_refusals_say_why():
    pytest.importorskip("transformers")
    from dptorch.integrations.hf import PrivacyArguments
    from dptorch.integrations.hf.checks import setup_problems

    privacy = PrivacyArguments(noise_multiplier=1.0)
    assert setup_problems(fake_trainer(world_size=2), privacy) == []  # DDP is supported
    for zero, refused in (({"stage": 2}, ""), ({"stage": 3}, ""), ({"stage": 0}, "ZeRO stage 0"),
                          ({"stage": 3, "stage3_module_granularity_threshold": 100}, "leaf modules"),
                          ({"stage": 1, "offload_param": {"device": "cpu"}}, "offload_param")):
        # ZeRO-1/2/3 are supported (test_hf_deepspeed.py trains them)
        deepspeed = fake_trainer()
        deepspeed.is_deepspeed_enabled = True
        config = {"zero_optimization": zero, "gradient_clipping": 0.0}
        deepspeed.accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
            hf_ds_config=SimpleNamespace(config=config))))
        problems = setup_problems(deepspeed, privacy)
        assert (problems == []) if not refused else (refused in " ".join(problems) and len(problems) == 1)
    for version, refused in ((1, True), (2, False)):
        fsdp = fake_trainer(world_size=2)
        fsdp.is_fsdp_enabled = True
        fsdp.accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version)))
        assert ("FlatParameter" in " ".join(setup_problems(fsdp, privacy))) is refused  # FSDP2 is supported
    assert not any("fp16" in p for p in setup_problems(fake_trainer(fp16=True), privacy))  # one process: DPGradScaler
    assert setup_problems(fake_trainer(fp16=True, world_size=2), privacy) == []  # DDP: DPGradScaler on every rank
    fsdp16 = fake_trainer(fp16=True, world_size=2)
    fsdp16.is_fsdp_enabled = True
    fsdp16.accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2)))
    assert "fp16 under FSDP" in " ".join(setup_problems(fsdp16, privacy))
    assert "DataParallel" in " ".join(setup_problems(fake_trainer(n_gpu=2), privacy))

    class TrlLike(SimpleNamespace):
        pass

    TrlLike.__module__ = "trl.trainer.sft_trainer"
    assert setup_problems(TrlLike(**vars(fake_trainer(world_size=2))), privacy) == []  # TRL on several processes


def test_parallelism_config_is_refused_unless_it_is_hsdp_under_fsdp2():
    """Accelerate's ParallelismConfig: data-parallel sizes under FSDP2 (HSDP, test_hf_hsdp.py trains it) pass;
    tensor / context / sequence parallelism split a sample and are refused, as is the config without FSDP2."""
    pytest.importorskip("transformers")
    from dptorch.integrations.hf import PrivacyArguments
    from dptorch.integrations.hf.checks import setup_problems

    privacy = PrivacyArguments(noise_multiplier=1.0)

    def problems(version, **sizes):
        names = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
        config = SimpleNamespace(**{f"{name}_size": sizes.get(name, 1) for name in names})
        trainer = fake_trainer(world_size=4, parallelism_config=config)
        if version is not None:
            trainer.is_fsdp_enabled = True
            trainer.accelerator = SimpleNamespace(state=SimpleNamespace(
                fsdp_plugin=SimpleNamespace(fsdp_version=version), parallelism_config=config))
        return " ".join(setup_problems(trainer, privacy))

    assert problems(2, dp_replicate=2, dp_shard=2) == ""
    assert problems(2, dp_shard=4) == ""
    for name in ("tp", "cp", "sp"):
        assert "splits one sample's" in problems(2, dp_shard=2, **{name: 2})
    assert "without FSDP2" in problems(None, dp_replicate=4)
    assert "without FSDP2" in problems(1, dp_replicate=2, dp_shard=2) and "FlatParameter" in problems(1, dp_shard=4)

def test_ddp_switch_needs_ddp_and_is_found_through_wrappers():
    with pytest.raises(TypeError):
        keep_out_of_gradient_sync(torch.nn.Linear(2, 2))
    inner = torch.nn.Linear(2, 2)
    assert ddp_wrappers(SimpleNamespace(module=inner)) == [] and ddp_wrappers(inner) == []
