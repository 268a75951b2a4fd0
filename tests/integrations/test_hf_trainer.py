"""DPTrainer on the real transformers Trainer: privacy, exact updates, checkpoints, refusals."""

import copy
import math
import os

import pytest
import torch

pytest.importorskip("transformers")

from datasets import Dataset  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from dptorch.integrations.hf import (  # noqa: E402
    PRIVACY_STATE_NAME,
    DataCollatorForPrivateCausalLanguageModeling,
    DPTrainer,
    PoissonMicroBatchSampler,
    PrivacyArguments,
    PrivacyBudget,
    causal_lm_per_sample_loss,
    private,
)
from dptorch.grad_sample.errors import PerSampleGradientError  # noqa: E402
from dptorch.optim.optimizer import DPOptimizer  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    assert_torch_compile_trains_as_uncompiled,
    clipped_unit_update,
    cpu_training_args,
    lm_dataset,
    tiny_gpt2,
    tiny_llama,
    trainable_copy,
    without_dropout,
    word_tokenizer,
)

TOKENIZER = word_tokenizer()
COLLATE = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER)


def make_trainer(tmp_path, model=None, dataset=None, trainer_cls=DPTrainer, privacy=None, **args):
    torch.manual_seed(0)
    model = model if model is not None else tiny_gpt2(TOKENIZER)
    defaults = dict(max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2, optim="sgd",
                    lr_scheduler_type="constant", learning_rate=0.05, max_grad_norm=0.0)
    defaults.update(args)
    kwargs = dict(model=model, args=cpu_training_args(str(tmp_path), **defaults),
                  train_dataset=dataset if dataset is not None else lm_dataset(TOKENIZER, 32), data_collator=COLLATE)
    if trainer_cls is not Trainer:
        kwargs["privacy_args"] = privacy or PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3)
    return trainer_cls(**kwargs)


def test_trains_privately_and_logs_epsilon_and_the_privatised_norm(tmp_path):
    trainer = make_trainer(tmp_path)
    model = trainer.model
    before = trainable_copy(model)
    trainer.train()
    assert trainer.model is model and isinstance(trainer.optimizer.optimizer, DPOptimizer)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    logs = [h for h in trainer.state.log_history if "loss" in h]
    epsilons = [h["epsilon"] for h in logs]
    assert len(logs) == 3 and 0 < epsilons[0] < epsilons[1] < epsilons[2]
    assert trainer.get_epsilon() == pytest.approx(epsilons[-1]) and trainer.privacy_budget.steps == 3
    # The logged grad_norm is the noisy gradient's: ~ sigma * C * sqrt(d) / expected batch (raw norms are ~1).
    dims = sum(p.numel() for p in model.parameters())
    for h in logs:
        assert h["grad_norm"] == pytest.approx(math.sqrt(dims) / 8, rel=0.1)
    report = trainer.privacy_report()
    assert report["steps"] == 3 and report["sample_rate"] == pytest.approx(8 / 32)
    fresh = tiny_gpt2(TOKENIZER)
    trainer.save_model(str(tmp_path / "saved"))
    saved = type(model).from_pretrained(str(tmp_path / "saved"))
    assert set(saved.state_dict()) == set(fresh.state_dict())  # clean keys: nothing of the hooks leaks


def equal_length_rows(count, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"input_ids": torch.randint(4, len(TOKENIZER), (count, length), generator=g).tolist()})


def test_without_noise_and_clipping_a_step_equals_the_plain_trainer_step(tmp_path):
    """q=1 (the whole data each step), equal lengths: HF's token mean = mean of per-sample means.

    Llama, not GPT-2: with GPT-2 (``loss_type=None``) the plain Trainer counts unshifted labels in
    num_items_in_batch, so its loss is scaled by (T-1)/T.
    """
    data = equal_length_rows(6)
    torch.manual_seed(0)
    model = tiny_llama(TOKENIZER)
    plain = make_trainer(tmp_path / "plain", copy.deepcopy(model), data, Trainer, max_steps=1, per_device_train_batch_size=6,
                         gradient_accumulation_steps=1)
    private_ = make_trainer(tmp_path / "dp", copy.deepcopy(model), data, max_steps=1, per_device_train_batch_size=3,
                            privacy=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=1e6, target_delta=1e-3))
    assert private_.sampling_plan.sample_rate == 1.0
    plain.train()
    private_.train()
    for (name, p), q in zip(plain.model.named_parameters(), private_.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name


def unit_reference_update(model, dataset, unit_column, clip, lr):
    """-lr * sum over units of clip(sum of the unit's row gradients) / number of units."""
    units = {}
    for i, row in enumerate(dataset):
        units.setdefault(row[unit_column] if unit_column else i, []).append({"input_ids": row["input_ids"]})
    return clipped_unit_update(model, list(units.values()), COLLATE, causal_lm_per_sample_loss, clip, lr)


@pytest.mark.parametrize("unit_column, mode", [(None, "hooks"), ("user", "hooks"), ("user", "bk")])
def test_a_step_clips_each_unit_exactly(tmp_path, unit_column, mode):
    """Noise 0, q=1, GA=2: the update is -lr * sum_u clip(g_u) / N_units, rows of a unit summed first."""
    data = lm_dataset(TOKENIZER, 8).add_column("user", ["a", "b", "a", "c", "d", "b", "e", "a"])
    model = without_dropout(tiny_gpt2(TOKENIZER))
    num_units = 5 if unit_column else 8
    trainer = make_trainer(
        tmp_path, copy.deepcopy(model), data, max_steps=1, per_device_train_batch_size=math.ceil(num_units / 2),
        privacy=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=0.3, privacy_unit_column=unit_column,
                                 grad_sample_mode=mode, target_delta=1e-3),
    )
    assert trainer.sampling_plan.num_units == num_units and trainer.sampling_plan.expected_batch_size == num_units
    start = trainable_copy(trainer.model)
    trainer.train()
    expected = unit_reference_update(model, data, unit_column, clip=0.3, lr=0.05)
    for (name, p), delta in zip(trainer.model.named_parameters(), expected):
        assert torch.allclose(p - start[name], delta, atol=2e-6), name


class CollatorSpy:
    def __init__(self, collate):
        self.collate, self.sizes = collate, []

    def __call__(self, rows):
        self.sizes.append(len(rows))
        return self.collate(rows)


def test_empty_poisson_batches_skip_the_model_but_still_add_noise_and_count(tmp_path):
    spy = CollatorSpy(COLLATE)
    trainer = make_trainer(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=6,
                           dataset=lm_dataset(TOKENIZER, 40),
                           privacy=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, sampling_seed=5))
    trainer.data_collator = spy
    before = trainable_copy(trainer.model)
    trainer.train()
    assert len(trainer.get_train_dataloader()) == 2 * trainer.sampling_plan.steps_per_epoch  # GA micro-batches per step
    plan = trainer.sampling_plan  # replay the run's draws: a new sampler with its seed (the trainer's never repeats)
    sampler = PoissonMicroBatchSampler(trainer.privacy_units, plan.sample_rate, steps=plan.steps_per_epoch,
                                       micro_batches=plan.micro_batches, seed=5)
    drawn = [len(rows) for rows in sampler][:12]
    assert 0 in drawn  # this seed leaves micro-batches empty...
    assert 0 not in spy.sizes and spy.sizes[: 12 - drawn.count(0)] == [n for n in drawn if n]  # ...never collated
    assert trainer.privacy_budget.steps == 6 and len(trainer.privacy_budget.accountant) == 6
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


class SaveBeforeOptimizerStep(TrainerCallback):
    """Like a JIT checkpoint on SIGTERM: saved after the backward passes of step 3, before its optimizer step."""

    def __init__(self):
        self.trainer = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.trainer._save_checkpoint(self.trainer.model, trial=None)


@pytest.mark.parametrize("when", ["after_step", "before_optimizer_step"])
def test_resume_continues_epsilon_and_parameters_exactly(tmp_path, when):
    settings = dict(max_steps=4, per_device_train_batch_size=2)
    if when == "after_step":
        settings.update(save_strategy="steps", save_steps=2)
    # Mid-step, the Trainer saves torch's RNG after the forward passes: dropout would then differ on resume.
    model = tiny_gpt2 if when == "after_step" else lambda tokenizer: without_dropout(tiny_gpt2(tokenizer))
    torch.manual_seed(0)
    full = make_trainer(tmp_path / "full", model(TOKENIZER), **settings)  # secret sampling and noise seeds
    if when == "before_optimizer_step":
        callback = SaveBeforeOptimizerStep()
        callback.trainer = full
        full.add_callback(callback)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / PRIVACY_STATE_NAME).is_file()
    torch.manual_seed(0)
    resumed = make_trainer(tmp_path / "resumed", model(TOKENIZER), **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.privacy_budget.steps == 4
    assert resumed.get_epsilon() == full.get_epsilon()
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_resume_refuses_a_checkpoint_without_privacy_state(tmp_path):
    trainer = make_trainer(tmp_path / "a", max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    os.remove(tmp_path / "a" / "checkpoint-1" / PRIVACY_STATE_NAME)
    with pytest.raises(ValueError, match="epsilon would restart at 0"):
        make_trainer(tmp_path / "b", max_steps=2).train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))


def test_training_stops_before_epsilon_would_pass_max_epsilon(tmp_path):
    budget = PrivacyBudget(accountant="pld", noise_multiplier=1.0, sample_rate=0.25, delta=1e-3)
    cap = (budget.epsilon_after(2) + budget.epsilon_after(3)) / 2
    trainer = make_trainer(tmp_path, max_steps=6, privacy=PrivacyArguments(noise_multiplier=1.0, max_epsilon=cap, target_delta=1e-3))
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.get_epsilon() <= cap


def test_target_epsilon_calibrates_the_noise_to_the_planned_steps(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=3, privacy=PrivacyArguments(target_epsilon=2.0, target_delta=1e-3))
    trainer.train()
    assert trainer.state.global_step == 3 and 1.96 <= trainer.get_epsilon() <= 2.0


class SumLossTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(args=dict(ignore_data_skip=True)), "ignore_data_skip"),
        (dict(args=dict(train_sampling_strategy="group_by_length")), "train_sampling_strategy"),
        (dict(privacy=PrivacyArguments(noise_multiplier=1.0, target_delta=0.1)), "target_delta"),
        (dict(privacy=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, privacy_unit_column="user")), "not a column"),
        (dict(trainer_cls=private(SumLossTrainer)), "overrides compute_loss"),
        (dict(dataset=lm_dataset(TOKENIZER, 8).to_iterable_dataset()), "map-style"),
    ],
)
def test_bad_setups_fail_at_construction_naming_the_fix(tmp_path, change, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_trainer(tmp_path, dataset=change.get("dataset"), trainer_cls=change.get("trainer_cls", DPTrainer),
                     privacy=change.get("privacy"), **change.get("args", {}))


@pytest.mark.parametrize("capture", [None, False])
def test_torch_compile_trains_as_the_uncompiled_trainer(tmp_path, capture):
    """``torch_compile=True``: Accelerate compiles the model. By default the step is captured and its graph compiled
    (test_trainer_captured.py); with ``capture_step=False`` the private forwards run eagerly (each turns Dynamo off
    for the compiled call). Either way the steps are the uncompiled trainer's (captured, each micro-batch size traced:
    replays of a fixed width add their sums in another order, test_trainer_captured.py)."""
    def trained(folder, **args):
        privacy = PrivacyArguments(noise_multiplier=0.0, target_delta=1e-3, sampling_seed=1, capture_step=capture,
                                   capture_pad_to_multiple_of=1 if capture is None else None)
        trainer = make_trainer(tmp_path / folder, model=without_dropout(tiny_gpt2(TOKENIZER)), max_steps=2, **args,
                               privacy=privacy)
        trainer.train()
        return trainer

    assert_torch_compile_trains_as_uncompiled(trained)


def test_a_loss_that_mixes_samples_is_refused(tmp_path):
    def batch_mean(outputs, labels):
        return causal_lm_per_sample_loss(outputs, labels).mean()

    trainer = DPTrainer(model=tiny_gpt2(TOKENIZER), args=cpu_training_args(str(tmp_path), max_steps=1),
                        train_dataset=lm_dataset(TOKENIZER, 16), data_collator=COLLATE, per_sample_loss_func=batch_mean,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3))
    with pytest.raises(Exception, match="one loss per row"):
        trainer.train()


def test_an_optimizer_built_on_other_parameters_is_refused(tmp_path):
    """Opacus #820: an optimizer holding parameters the model no longer uses would train nothing."""
    model = tiny_gpt2(TOKENIZER)
    stale = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)
    trainer = DPTrainer(model=model, args=cpu_training_args(str(tmp_path), max_steps=1), optimizers=(stale, None),
                        train_dataset=lm_dataset(TOKENIZER, 16), data_collator=COLLATE,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3))
    with pytest.raises(ValueError, match="not in trainer.model"):
        trainer.train()


def test_private_of_a_declared_sum_subclass_uses_its_loss(tmp_path):
    class Declared(Trainer):
        compute_loss_sums_per_sample_losses = True
        calls = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            Declared.calls += 1
            labels = inputs.pop("labels")
            return causal_lm_per_sample_loss(model(**inputs), labels).sum()

    cls = private(Declared)
    assert private(Declared) is cls and private(cls) is cls and private(Trainer) is DPTrainer
    trainer = make_trainer(tmp_path, trainer_cls=cls, max_steps=1)
    trainer.train()
    assert Declared.calls >= 1 and trainer.privacy_budget.steps == 1


def test_eval_uses_the_parents_loss_and_captures_nothing(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1, per_device_eval_batch_size=4)
    metrics = trainer.evaluate(lm_dataset(TOKENIZER, 8, seed=1))
    assert "eval_loss" in metrics and "epsilon" not in metrics
    assert trainer.dp_hooks.grad_samples == {}


def loss_func_trainer(tmp_path, model, data, compute_loss_func):
    """One noiseless step at q = 1 (two micro-batches), HF's own way of passing the loss function."""
    return DPTrainer(
        model=model, args=cpu_training_args(str(tmp_path), max_steps=1, per_device_train_batch_size=3,
                                            gradient_accumulation_steps=2, optim="sgd", learning_rate=0.05,
                                            lr_scheduler_type="constant", max_grad_norm=0.0),
        train_dataset=data, data_collator=COLLATE, compute_loss_func=compute_loss_func,
        privacy_args=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=0.3, target_delta=1e-3),
    )


def test_a_compute_loss_func_summing_per_sample_terms_trains_as_the_batch_of_one_reference(tmp_path):
    seen = []

    def summed(outputs, labels, num_items_in_batch=None):
        seen.append(num_items_in_batch)
        return causal_lm_per_sample_loss(outputs, labels).sum()  # each row's token mean, summed over rows

    data = lm_dataset(TOKENIZER, 6)
    model = without_dropout(tiny_gpt2(TOKENIZER))
    dp = loss_func_trainer(tmp_path, copy.deepcopy(model), data, summed)
    assert dp.sampling_plan.sample_rate == 1.0
    start = trainable_copy(dp.model)
    dp.train()
    assert seen and all(n is None for n in seen)  # the batch's token count would couple the samples
    expected = clipped_unit_update(model, [[{"input_ids": row["input_ids"]}] for row in data], COLLATE,
                                   causal_lm_per_sample_loss, 0.3, 0.05)
    for (name, p), delta in zip(dp.model.named_parameters(), expected):
        assert torch.allclose(p - start[name], delta, atol=2e-6), name


def test_a_compute_loss_func_batch_mean_is_refused_at_its_first_backward_with_no_parameter_moved(tmp_path):
    def batch_mean(outputs, labels, num_items_in_batch=None):  # HF's fallback when no count is given
        return causal_lm_per_sample_loss(outputs, labels).mean()

    dp = loss_func_trainer(tmp_path, without_dropout(tiny_gpt2(TOKENIZER)), lm_dataset(TOKENIZER, 6), batch_mean)
    start = trainable_copy(dp.model)
    with pytest.raises(PerSampleGradientError, match="mean over the batch dimension"):
        dp.train()
    assert all(torch.equal(p, start[name]) for name, p in dp.model.named_parameters())
