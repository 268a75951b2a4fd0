"""DPCallback (dp-transformers' ``PrivacyEngineCallback`` role): DP-SGD on a plain Trainer.

What it guarantees is tested exactly (the update clips every row and adds no other gradient; the
plan accounts every optimizer step); shuffled batches are accounted per pass (each epoch one
Gaussian of sigma / 2, no amplification); what it cannot guarantee is refused or labelled: another
sampler is refused unless ``allow_shuffled_batches=True``, and then epsilon is reported only as
``epsilon_if_poisson``.
"""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer  # noqa: E402

from dptorch.accounting import create_accountant  # noqa: E402
from dptorch.grad_sample.errors import PerSampleGradientError  # noqa: E402
from dptorch.grad_sample.capture.hooks import is_attached  # noqa: E402
from dptorch.integrations.hf import (  # noqa: E402
    EPSILON_IF_POISSON,
    DataCollatorForPrivateCausalLanguageModeling,
    DPCallback,
    PrivacyArguments,
)
from dptorch.grad_sample.units.per_sample_losses import causal_lm_per_sample_loss  # noqa: E402
from dptorch.optim.optimizer import DPOptimizer  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    assert_torch_compile_trains_as_uncompiled,
    clipped_unit_update,
    cpu_training_args,
    lm_dataset,
    tiny_gpt2,
    without_dropout,
    word_tokenizer,
)

TOKENIZER = word_tokenizer()
COLLATE = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER)


def plain_trainer(tmp_path, callback, model=None, dataset=None, **overrides):
    torch.manual_seed(0)
    settings = dict(max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2, optim="sgd",
                    lr_scheduler_type="constant", learning_rate=0.05, max_grad_norm=0.0)
    settings.update(overrides)
    return Trainer(model=model if model is not None else tiny_gpt2(TOKENIZER),
                   args=cpu_training_args(str(tmp_path), **settings),
                   train_dataset=dataset if dataset is not None else lm_dataset(TOKENIZER, 32),
                   data_collator=COLLATE, callbacks=[callback])


def test_shuffled_batches_are_accounted_per_pass_by_default(tmp_path):
    """32 rows, 4 x GA 2: 4 steps per epoch; 6 steps run 2 epochs, each one Gaussian of sigma / 2 at rate 1."""
    sigma = 1.2
    callback = DPCallback(PrivacyArguments(noise_multiplier=sigma, target_delta=1e-3))
    trainer = plain_trainer(tmp_path, callback, max_steps=6)
    trainer.train()
    assert callback.plan.shuffled and callback.plan.steps == 6 and callback.plan.passes == 2
    assert callback.plan.accountant.history == [[sigma / 2, 1.0, 2]]
    counter = create_accountant("pld")
    counter.step(noise_multiplier=sigma / 2, sample_rate=1.0, num_steps=2)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[-1]["epsilon"] == pytest.approx(counter.get_epsilon(1e-3), rel=1e-9) and EPSILON_IF_POISSON not in logs[-1]
    report = callback.privacy_report()
    assert report["passes"] == 2 and report["adjacency"] == "replace one unit" and "epsilon" in report


def test_calibration_over_the_passes_the_run_spans(tmp_path):
    callback = DPCallback(PrivacyArguments(target_epsilon=4.0, target_delta=1e-3))
    plain_trainer(tmp_path, callback, max_steps=6).train()
    counter = create_accountant("pld")
    counter.step(noise_multiplier=callback.plan.noise_multiplier / 2, sample_rate=1.0, num_steps=2)
    assert 4.0 * 0.98 <= counter.get_epsilon(1e-3) <= 4.0
    assert callback.get_epsilon() <= 4.0


def test_a_sampler_it_cannot_account_is_refused_by_default(tmp_path):
    class WeightedTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.WeightedRandomSampler([1.0] * len(self.train_dataset), len(self.train_dataset))

    torch.manual_seed(0)
    callback = DPCallback(PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3))
    trainer = WeightedTrainer(model=tiny_gpt2(TOKENIZER), args=cpu_training_args(str(tmp_path), max_steps=2,
                              per_device_train_batch_size=4, optim="sgd", max_grad_norm=0.0),
                              train_dataset=lm_dataset(TOKENIZER, 32), data_collator=COLLATE, callbacks=[callback])
    with pytest.raises(ValueError, match="cannot replace the Trainer's sampler.*WeightedRandomSampler"):
        trainer.train()


def test_with_shuffled_batches_allowed_it_trains_and_reports_epsilon_only_as_a_poisson_assumption(tmp_path):
    callback = DPCallback(PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3), allow_shuffled_batches=True)
    trainer = plain_trainer(tmp_path, callback)
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    q = 8 / 32  # per_device_train_batch_size * gradient_accumulation_steps / rows
    counter = create_accountant("pld")
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and callback.plan.steps == 3
    for step, log in enumerate(logs, start=1):
        counter.step(noise_multiplier=1.0, sample_rate=q)
        assert "epsilon" not in log and log[EPSILON_IF_POISSON] == pytest.approx(counter.get_epsilon(1e-3), rel=1e-9)
    report = callback.privacy_report()
    assert "epsilon" not in report and "not a proven bound" in report["note"] and report["sample_rate"] == q
    # on_train_end removed everything: the model and the optimizer are as they were
    assert not any(is_attached(m) for m in model.modules())
    assert not isinstance(trainer.optimizer.optimizer, DPOptimizer)
    assert all(not hook for m in model.modules() for hook in (m._forward_hooks, m._forward_pre_hooks))


def reference_update(model, dataset, rows, clip, lr):
    """-lr * sum over rows of clip(row gradient) / len(rows): each row alone, nothing shared."""
    units = [[{"input_ids": dataset[row]["input_ids"]}] for row in rows]
    return clipped_unit_update(model, units, COLLATE, causal_lm_per_sample_loss, clip, lr)


@pytest.mark.parametrize("clip", [1e-3, 1e3])
def test_a_step_clips_each_row_and_sums_per_sample_losses_exactly(tmp_path, clip):
    """Noise 0, sequential batches, GA=2: the update is -lr * sum_i clip(g_i) / (batch * GA)."""
    data = lm_dataset(TOKENIZER, 16)
    model = without_dropout(tiny_gpt2(TOKENIZER))
    callback = DPCallback(PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=clip, target_delta=1e-3),
                          allow_shuffled_batches=True)
    trainer = plain_trainer(tmp_path, callback, copy.deepcopy(model), data, max_steps=1,
                            train_sampling_strategy="sequential")
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.warns(UserWarning, match="not private"):
        trainer.train()
    expected = reference_update(model, data, list(range(8)), clip=clip, lr=0.05)
    for (name, p), delta in zip(trainer.model.named_parameters(), expected):
        assert torch.allclose(p - start[name], delta, atol=2e-6), name


def test_a_loss_computed_outside_the_model_is_refused(tmp_path):
    def batch_loss(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().mean()

    callback = DPCallback(PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3), allow_shuffled_batches=True)
    trainer = plain_trainer(tmp_path, callback)
    trainer.compute_loss_func = batch_loss
    with pytest.raises(PerSampleGradientError, match="outside the model"):
        trainer.train()


@pytest.mark.parametrize("setting, message", [
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
    (dict(train_sampling_strategy="group_by_length"), "length-grouped"),
])
def test_set_ups_it_cannot_keep_private_are_refused(tmp_path, setting, message):
    callback = DPCallback(PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3), allow_shuffled_batches=True)
    with pytest.raises(ValueError, match=message):
        plain_trainer(tmp_path, callback, **setting).train()


def test_torch_compile_trains_as_the_uncompiled_run(tmp_path):
    """Accelerate compiles the model before the callback attaches; Dynamo traces it at the first forward, with the
    hooks: the private forwards run eagerly, the steps are the uncompiled run's."""
    def trained(folder, **settings):
        callback = DPCallback(PrivacyArguments(noise_multiplier=0.0, target_delta=1e-3), allow_shuffled_batches=True)
        trainer = plain_trainer(tmp_path / folder, callback, model=without_dropout(tiny_gpt2(TOKENIZER)), **settings)
        trainer.train()
        return trainer

    assert_torch_compile_trains_as_uncompiled(trained)


def test_privacy_units_are_refused_at_construction():
    with pytest.raises(ValueError, match="privacy units"):
        DPCallback(PrivacyArguments(noise_multiplier=1.0, privacy_unit_column="user"))


def test_banded_noise_is_refused_at_construction():
    with pytest.raises(ValueError, match="DPCallback adds independent noise only"):
        DPCallback(PrivacyArguments(noise_multiplier=1.0, noise_mechanism="bandmf", bands=2))


def test_a_poisson_loader_behind_the_trainer_is_accounted_at_its_own_rate(tmp_path):
    """A loader drawing from a dptorch Poisson sampler (e.g. a Trainer subclass that builds one) gives
    the plan its rate, units and steps, and epsilon is reported as such."""
    from torch.utils.data import DataLoader

    from dptorch.data import PoissonBatchSampler
    from dptorch.integrations.hf import PoissonMicroBatchSampler, PrivacyUnits

    data = lm_dataset(TOKENIZER, 32)
    args = cpu_training_args(str(tmp_path), gradient_accumulation_steps=2)
    callback = DPCallback(PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3))
    loader = DataLoader(data, batch_sampler=PoissonBatchSampler(32, 0.25, steps=5))
    assert callback._sampling_of(args, loader) == (0.25, 32, 5, True)
    micro = PoissonMicroBatchSampler(PrivacyUnits.one_per_row(32), 0.5, steps=2, micro_batches=2)
    assert callback._sampling_of(args, DataLoader(data, batch_sampler=micro)) == (0.5, 32, 2, True)
    callback.poisson = True
    assert callback.epsilon_key == "epsilon"


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_an_encoder_decoder_step_is_the_batch_of_one_reference(tmp_path, name):
    """Seq2SeqTrainer with the callback, noise 0, sequential batches, GA 2, targets of several lengths padded with
    -100: the update is -lr * sum_i clip(g_i) / 8 (lr 1, C 0.5), g_i HF's own loss of row i alone (the model builds its decoder
    inputs from its labels); the callback builds each row's from its own labels."""
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    from tests.integrations.tiny import place_dataset, tiny_bart, tiny_t5

    data = place_dataset(TOKENIZER, 8)
    assert len({len(labels) for labels in data["labels"]}) > 1
    torch.manual_seed(0)
    model = without_dropout((tiny_t5 if name == "t5" else tiny_bart)(TOKENIZER))
    clip, lr = 0.5, 1.0
    callback = DPCallback(PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=clip, target_delta=1e-3),
                          allow_shuffled_batches=True)
    args = cpu_training_args(str(tmp_path), Seq2SeqTrainingArguments, max_steps=1, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, optim="sgd", lr_scheduler_type="constant",
                             learning_rate=lr, max_grad_norm=0.0, train_sampling_strategy="sequential")
    trainer = Seq2SeqTrainer(model=copy.deepcopy(model), args=args, train_dataset=data,
                             data_collator=DataCollatorForSeq2Seq(TOKENIZER), callbacks=[callback])
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.warns(UserWarning, match="not private"):
        trainer.train()
    expected = clipped_unit_update(model, [[row] for row in data], DataCollatorForSeq2Seq(TOKENIZER), None, clip, lr)
    assert max(float(d.abs().max()) for d in expected) > 1e-2  # far above the tolerance below
    for (param, p), delta in zip(trainer.model.named_parameters(), expected):
        assert torch.allclose(p - start[param], delta, atol=2e-6), param


def test_labels_padded_with_a_token_are_refused(tmp_path):
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    from tests.integrations.tiny import place_dataset, tiny_t5

    callback = DPCallback(PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3), allow_shuffled_batches=True)
    args = cpu_training_args(str(tmp_path), Seq2SeqTrainingArguments, max_steps=1)
    trainer = Seq2SeqTrainer(model=tiny_t5(TOKENIZER), args=args,
                             train_dataset=place_dataset(TOKENIZER, 8), callbacks=[callback],
                             data_collator=DataCollatorForSeq2Seq(TOKENIZER, label_pad_token_id=TOKENIZER.pad_token_id))
    with pytest.raises(ValueError, match="label_pad_token_id"):
        trainer.train()
