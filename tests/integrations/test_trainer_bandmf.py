"""DP-BandMF in the private Trainer: PrivacyArguments(noise_mechanism="bandmf", bands=b).

b = 1 is DP-SGD; the Trainer's logical batches are b-min-separated cyclic Poisson draws; epsilon
(and the calibrated noise) is the reduction's (ceil(n / b) steps at the partition rate); a resumed
run continues the same partitions, draws and correlated noise."""

import math

import pytest
import torch

pytest.importorskip("transformers")

from dptorch.accounting import create_accountant, get_noise_multiplier  # noqa: E402
from dptorch.integrations.hf import (  # noqa: E402
    PRIVACY_STATE_NAME,
    DataCollatorForPrivateCausalLanguageModeling,
    DPTrainer,
    PrivacyArguments,
)
from dptorch.integrations.hf.sampling import UNIT_IDS_KEY  # noqa: E402
from dptorch.noise.banded import BandedNoise  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    cpu_training_args,
    lm_dataset,
    tiny_gpt2,
    without_dropout,
    word_tokenizer,
)

TOKENIZER = word_tokenizer()
ROWS = 32


class UnitSpyTrainer(DPTrainer):
    """Records the privacy units of every micro-batch with the (noise) step it feeds: the plan's step count."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        if UNIT_IDS_KEY in inputs:
            self.seen.append((self.privacy_plan.steps, inputs[UNIT_IDS_KEY].tolist()))
        return super().training_step(model, inputs, num_items_in_batch)


def make_trainer(tmp_path, privacy, trainer_cls=DPTrainer, units=False, **args):
    torch.manual_seed(0)
    settings = dict(max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2, optim="sgd",
                    lr_scheduler_type="constant", learning_rate=0.05, max_grad_norm=0.0)
    settings.update(args)
    dataset = lm_dataset(TOKENIZER, ROWS)
    if units:
        dataset = dataset.add_column("user", list(range(ROWS)))
    model = without_dropout(tiny_gpt2(TOKENIZER))
    trainer = trainer_cls(model=model, args=cpu_training_args(str(tmp_path), **settings),
                          train_dataset=dataset, data_collator=DataCollatorForPrivateCausalLanguageModeling(TOKENIZER),
                          privacy_args=privacy)
    trainer.seen = []
    return trainer


def bandmf(bands, **options):
    return PrivacyArguments(noise_mechanism="bandmf", bands=bands, target_delta=1e-3, **options)


def test_one_band_is_dp_sgd(tmp_path):
    seeds = dict(noise_multiplier=0.8, sampling_seed=11, noise_seed=12)
    plain = make_trainer(tmp_path / "sgd", PrivacyArguments(target_delta=1e-3, **seeds))
    banded = make_trainer(tmp_path / "band", bandmf(1, **seeds))
    plain.train()
    banded.train()
    assert isinstance(banded.optimizer.optimizer.noise_generator, BandedNoise)
    assert banded.privacy_plan.sample_rate == plain.privacy_plan.sample_rate
    assert banded.get_epsilon() == plain.get_epsilon()
    for (name, p), q in zip(plain.model.named_parameters(), banded.model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("runs", [1, 2])
def test_trainer_batches_are_b_min_separated_cyclic_poisson_draws(tmp_path, runs):
    """Also over two train() calls of one trainer (the draws the first one took ahead are skipped)."""
    bands = 3
    trainer = make_trainer(tmp_path, bandmf(bands, noise_multiplier=1.0, privacy_unit_column="user"),
                           trainer_cls=UnitSpyTrainer, units=True, max_steps=12 // runs + 1,
                           per_device_train_batch_size=4)
    sampling = trainer.sampling_plan
    logical = 4 * 2
    assert sampling.sample_rate == bands * logical / ROWS and sampling.steps_per_epoch % bands == 0
    assert trainer.privacy_plan.expected_batch_size == logical and trainer.privacy_plan.bands == bands
    for _ in range(runs):
        trainer.train()
    assert trainer.privacy_plan.steps == runs * (12 // runs + 1)
    partitions = [set(p.tolist()) for p in trainer._dp_sampler.logical.partitions]
    assert sorted(u for p in partitions for u in p) == list(range(ROWS))
    steps_of = {}
    for step, units in trainer.seen:
        assert set(units) <= partitions[step % bands], (step, units)
        for unit in units:
            steps_of.setdefault(unit, set()).add(step)
    assert trainer.seen and steps_of
    for unit, steps in steps_of.items():
        steps = sorted(steps)
        assert all(later - earlier >= bands for earlier, later in zip(steps, steps[1:])), (unit, steps)


def test_epsilon_and_calibration_are_the_reduction(tmp_path):
    bands, steps, delta = 2, 5, 1e-3
    trainer = make_trainer(tmp_path, bandmf(bands, target_epsilon=3.0), max_steps=steps)
    plan = trainer.privacy_plan
    q_p = bands * 4 / ROWS
    assert plan.sample_rate == q_p and plan.planned_steps == steps and plan.strategy.bands == bands
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=delta, sample_rate=q_p,
                                 steps=math.ceil(steps / bands), accountant="pld")
    assert trainer.noise_multiplier == sigma
    trainer.train()
    direct = create_accountant("pld")
    direct.step(noise_multiplier=sigma, sample_rate=q_p, num_steps=math.ceil(steps / bands))
    assert plan.steps == steps
    assert trainer.get_epsilon() == pytest.approx(direct.get_epsilon(delta), rel=1e-9)
    assert trainer.get_epsilon() <= 3.0
    report = trainer.privacy_report()
    assert report["noise_mechanism"] == "bandmf" and report["bands"] == bands


def test_resume_continues_partitions_draws_and_noise(tmp_path):
    privacy = dict(noise_multiplier=1.0)
    settings = dict(max_steps=5, save_strategy="steps", save_steps=3)
    full = make_trainer(tmp_path / "full", bandmf(3, **privacy), **settings)  # secret sampling and noise seeds
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / PRIVACY_STATE_NAME).is_file()
    resumed = make_trainer(tmp_path / "resumed", bandmf(3, **privacy), **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.privacy_plan.steps == 5 and resumed.get_epsilon() == full.get_epsilon()
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="adaptive"):
        bandmf(2, noise_multiplier=1.0, clipping="adaptive")
    with pytest.raises(ValueError, match="bands"):
        PrivacyArguments(noise_multiplier=1.0, noise_mechanism="bandmf")
    with pytest.raises(ValueError, match="bandmf"):
        PrivacyArguments(noise_multiplier=1.0, bands=2)
    with pytest.raises(ValueError, match="save_only_model"):
        make_trainer(tmp_path, bandmf(2, noise_multiplier=1.0), save_only_model=True)


def test_secure_mode_partitions_come_from_the_checkpointed_seed(tmp_path):
    trainer = make_trainer(tmp_path, bandmf(2, noise_multiplier=1.0, secure_mode=True), max_steps=2)
    trainer.train()
    assert trainer._dp_sampler.logical.partition_seed == trainer._dp_sampling_seed
    assert trainer.privacy_state_dict()["sampling"]["bands"] == 2 and trainer.get_epsilon() > 0
