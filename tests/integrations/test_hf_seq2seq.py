"""private(Seq2SeqTrainer) with T5 and BART: each sample's own token mean over its decoder tokens, exact clipped
sums, the plan's epsilon, and generation for evaluation untouched."""

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments  # noqa: E402
from transformers import T5ForConditionalGeneration  # noqa: E402

from dptorch.integrations.hf import PrivacyArguments, private  # noqa: E402
from dptorch.integrations.hf.seq2seq import with_decoder_inputs  # noqa: E402
from dptorch.plan import PrivacyPlan  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    clipped_unit_update,
    cpu_training_args,
    place_dataset,
    tiny_bart,
    tiny_t5,
    trainable_copy,
    without_dropout,
    word_tokenizer,
)

TOKENIZER = word_tokenizer()
DPSeq2SeqTrainer = private(Seq2SeqTrainer)
LR = 0.05


def build(name):
    torch.manual_seed(0)
    model = without_dropout({"t5": tiny_t5, "bart": tiny_bart}[name.split("-")[0]](TOKENIZER))
    if name.endswith("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q", "v"], lora_dropout=0.0,
                                                 task_type="SEQ_2_SEQ_LM"))
    return model


def make_trainer(tmp_path, model, dataset, trainer_cls=DPSeq2SeqTrainer, privacy=None, decoder_inputs="trainer",
                 eval_dataset=None, compute_metrics=None, **args):
    """A trainer of one noiseless step at q = 1 unless ``args`` say otherwise; ``decoder_inputs="collator"``: the
    collator builds ``decoder_input_ids`` (DataCollatorForSeq2Seq(model=...)), else the private trainer does."""
    settings = dict(max_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=2, optim="sgd",
                    lr_scheduler_type="constant", learning_rate=LR, max_grad_norm=0.0, predict_with_generate=True,
                    generation_max_length=6, per_device_eval_batch_size=4)
    settings.update(args)
    collator = DataCollatorForSeq2Seq(TOKENIZER, model=model if decoder_inputs == "collator" else None)
    kwargs = dict(model=model, args=cpu_training_args(str(tmp_path), Seq2SeqTrainingArguments, **settings),
                  train_dataset=dataset, data_collator=collator, eval_dataset=eval_dataset,
                  compute_metrics=compute_metrics)
    if trainer_cls is not Seq2SeqTrainer:
        kwargs["privacy_args"] = privacy or PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=1e6,
                                                             target_delta=1e-3)
    return trainer_cls(**kwargs)


def one_step(trainer):
    start = trainable_copy(trainer.model)
    trainer.train()
    return {n: p.detach() - start[n] for n, p in trainer.model.named_parameters() if p.requires_grad}


def assert_update(update, expected, atol):
    assert len(update) == len(expected)
    for (name, got), want in zip(update.items(), expected):
        assert torch.allclose(got, want, atol=atol), name


@pytest.mark.parametrize("name, mode, clip, decoder_inputs", [
    ("t5", "bk", 0.3, "trainer"), ("t5", "hooks", 1e6, "collator"), ("t5-lora", "bk", 0.05, "trainer"),
    ("bart", "bk", 1e6, "trainer"), ("bart", "hooks", 0.3, "collator"),
])
def test_a_step_is_the_batch_of_one_reference(tmp_path, name, mode, clip, decoder_inputs):
    """Noise 0, q = 1, GA = 2, targets of 2 or 3 words and EOS padded with -100: the update is
    -lr * sum_i clip(g_i) / N, g_i the gradient of HF's own loss of sample i alone (the model builds its decoder
    inputs from its labels). Unclipped (C = 1e6) it is the mean of the samples' gradients, each of its own token
    mean: any token count of the batch in a sample's loss would change it."""
    data = place_dataset(TOKENIZER, 8)
    assert len({len(labels) for labels in data["labels"]}) > 1 and len({len(ids) for ids in data["input_ids"]}) > 1
    model = build(name)
    trainer = make_trainer(tmp_path, copy.deepcopy(model), data, decoder_inputs=decoder_inputs,
                           privacy=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=clip,
                                                    grad_sample_mode=mode, target_delta=1e-3))
    assert trainer.sampling_plan.sample_rate == 1.0 and trainer.grad_sample_mode == mode
    expected = clipped_unit_update(model, [[row] for row in data], DataCollatorForSeq2Seq(TOKENIZER), None, clip, LR)
    assert_update(one_step(trainer), expected, atol=2e-6)


def test_hfs_token_mean_over_the_batch_is_not_what_the_private_step_computes(tmp_path):
    """The reference above can tell the two apart: with targets of different lengths, the plain Seq2SeqTrainer's
    step (the token mean over the accumulated batch, num_items_in_batch) differs from the mean of per-sample means."""
    data = place_dataset(TOKENIZER, 8)
    model = build("t5")
    plain = one_step(make_trainer(tmp_path, copy.deepcopy(model), data, Seq2SeqTrainer, decoder_inputs="collator"))
    per_sample = clipped_unit_update(model, [[row] for row in data], DataCollatorForSeq2Seq(TOKENIZER), None, 1e6, LR)
    gaps = [(got - want).abs().max().item() for got, want in zip(plain.values(), per_sample)]
    assert max(gaps) > 1e-4


def test_label_smoothing_is_hfs_smoothing_within_each_sample(tmp_path):
    """Targets of one length (then HF's token mean over the batch is the mean of per-sample means): one private
    step with label_smoothing_factor is the plain Seq2SeqTrainer's step, whose LabelSmoother smooths each token
    as the private per-sample loss does."""
    data = place_dataset(TOKENIZER, 24).filter(lambda row: len(row["labels"]) == 4).select(range(6))
    model = build("bart")
    smoothing = dict(label_smoothing_factor=0.2, decoder_inputs="collator")  # HF's smoother needs the collator's
    plain = one_step(make_trainer(tmp_path / "plain", copy.deepcopy(model), data, Seq2SeqTrainer,
                                  per_device_train_batch_size=6, gradient_accumulation_steps=1, **smoothing))
    private_ = one_step(make_trainer(tmp_path / "dp", copy.deepcopy(model), data, per_device_train_batch_size=3,
                                     **smoothing))
    unsmoothed = one_step(make_trainer(tmp_path / "raw", copy.deepcopy(model), data, per_device_train_batch_size=3))
    assert_update(private_, list(plain.values()), atol=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(private_.values(), unsmoothed.values())) > 1e-4


def exact_match(prediction):
    """compute_metrics: the share of generated answers equal to the target (pad and -100 dropped)."""
    def words(ids):
        return [int(i) for i in ids if i not in (-100, TOKENIZER.pad_token_id)]

    return {"exact": float(np.mean([words(p) == words(t) for p, t in zip(prediction.predictions,
                                                                          prediction.label_ids)]))}


def test_generation_in_evaluation_is_untouched_and_captures_nothing(tmp_path):
    """Evaluation generates (predict_with_generate: the encoder runs once, its outputs and the decoder's cache
    reused at every new token) after every private step: the run ends bit for bit where the run without
    evaluation ends, epsilon is the plan's for its steps, nothing is captured, and eval_loss and the generated
    tokens are the plain Seq2SeqTrainer's for the same weights."""
    train, held_out = place_dataset(TOKENIZER, 32), place_dataset(TOKENIZER, 8, seed=1)
    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, sampling_seed=3, noise_seed=5)
    runs = {}
    for evaluating in (True, False):
        settings = dict(eval_strategy="steps", eval_steps=1) if evaluating else {}
        trainer = make_trainer(tmp_path / str(evaluating), build("t5"), train, privacy=privacy, max_steps=3,
                               per_device_train_batch_size=2, eval_dataset=held_out, compute_metrics=exact_match,
                               **settings)
        trainer.train()
        runs[evaluating] = trainer
    evaluated, quiet = runs[True], runs[False]
    assert sum("eval_exact" in h for h in evaluated.state.log_history) == 3
    for (name, p), q in zip(evaluated.model.named_parameters(), quiet.model.parameters()):
        assert torch.equal(p, q), name
    plan = PrivacyPlan(noise_multiplier=1.0, sample_rate=4 / 32, num_units=32, accountant="pld")
    assert evaluated.get_epsilon() == quiet.get_epsilon() == plan.epsilon_after(3, 1e-3)
    assert evaluated.privacy_report()["steps"] == 3
    predicted = evaluated.predict(held_out)
    assert evaluated.dp_hooks.grad_samples == {}
    weights = build("t5")
    weights.load_state_dict(evaluated.model.state_dict())
    plain = make_trainer(tmp_path / "plain", weights, train, Seq2SeqTrainer, compute_metrics=exact_match)
    expected = plain.predict(held_out)
    assert predicted.predictions.shape[1] > 2 and np.array_equal(predicted.predictions, expected.predictions)
    assert predicted.metrics["test_loss"] == expected.metrics["test_loss"]
    assert predicted.metrics["test_exact"] == expected.metrics["test_exact"]


class BatchDependentShift(T5ForConditionalGeneration):
    """A model whose shift of the labels reads the batch (its size): each row's decoder inputs must not see it."""

    def prepare_decoder_input_ids_from_labels(self, labels):
        return super().prepare_decoder_input_ids_from_labels(labels) + (labels.shape[0] - 1)


def test_decoder_inputs_are_each_rows_own_labels_shifted():
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100], [10, 11, 12, 13]])
    model = BatchDependentShift(tiny_t5(TOKENIZER).config)
    inputs = with_decoder_inputs(model, {"input_ids": labels.clamp(min=0)}, labels)
    rows = [T5ForConditionalGeneration._shift_right(model, row) for row in labels.split(1)]
    assert torch.equal(inputs["decoder_input_ids"], torch.cat(rows)) and inputs["use_cache"] is False
    assert inputs["decoder_input_ids"].tolist()[1] == [TOKENIZER.pad_token_id, 8, 9, TOKENIZER.pad_token_id]
    given = torch.ones_like(labels)
    assert with_decoder_inputs(model, {"decoder_input_ids": given}, labels)["decoder_input_ids"] is given


class NoShift(T5ForConditionalGeneration):
    prepare_decoder_input_ids_from_labels = None


@pytest.mark.parametrize("model_cls, label_pad, message", [
    (T5ForConditionalGeneration, 0, "pads labels with 0 .label_pad_token_id."),
    (NoShift, -100, "without prepare_decoder_input_ids_from_labels"),
])
def test_set_ups_it_cannot_keep_per_sample_are_refused_at_construction(tmp_path, model_cls, label_pad, message):
    with pytest.raises(ValueError, match=message):
        DPSeq2SeqTrainer(model=model_cls(tiny_t5(TOKENIZER).config),
                         args=cpu_training_args(str(tmp_path), Seq2SeqTrainingArguments),
                         train_dataset=place_dataset(TOKENIZER, 8),
                         data_collator=DataCollatorForSeq2Seq(TOKENIZER, label_pad_token_id=label_pad),
                         privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3))
