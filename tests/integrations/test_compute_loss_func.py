"""Trainer(compute_loss_func=fn) in the private Trainer: the controller's loss check decides."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from dptorch.integrations.hf import (  # noqa: E402
    DataCollatorForPrivateCausalLanguageModeling,
    DPTrainer,
    PrivacyArguments,
    causal_lm_per_sample_loss,
)
from dptorch.grad_sample.errors import PerSampleGradientError  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    clipped_unit_update,
    cpu_training_args,
    lm_dataset,
    tiny_gpt2,
    trainable_copy,
    without_dropout,
    word_tokenizer,
)

TOKENIZER = word_tokenizer()
COLLATE = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER)
CLIP, LR = 0.3, 0.05


def trainer(tmp_path, model, data, compute_loss_func):
    """One noiseless step at q = 1 (two micro-batches), HF's own way of passing the loss function."""
    return DPTrainer(
        model=model, args=cpu_training_args(str(tmp_path), max_steps=1, per_device_train_batch_size=3,
                                            gradient_accumulation_steps=2, optim="sgd", learning_rate=LR,
                                            lr_scheduler_type="constant", max_grad_norm=0.0),
        train_dataset=data, data_collator=COLLATE, compute_loss_func=compute_loss_func,
        privacy_args=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=CLIP, target_delta=1e-3),
    )


def test_a_sum_of_per_sample_terms_trains_exactly_as_the_batch_of_one_reference(tmp_path):
    seen = []

    def summed(outputs, labels, num_items_in_batch=None):
        seen.append(num_items_in_batch)
        return causal_lm_per_sample_loss(outputs, labels).sum()  # each row's token mean, summed over rows

    data = lm_dataset(TOKENIZER, 6)
    model = without_dropout(tiny_gpt2(TOKENIZER))
    dp = trainer(tmp_path, copy.deepcopy(model), data, summed)
    assert dp.sampling_plan.sample_rate == 1.0
    start = trainable_copy(dp.model)
    dp.train()
    assert seen and all(n is None for n in seen)  # the batch's token count would couple the samples
    expected = clipped_unit_update(model, [[{"input_ids": row["input_ids"]}] for row in data], COLLATE,
                                   causal_lm_per_sample_loss, CLIP, LR)
    for (name, p), delta in zip(dp.model.named_parameters(), expected):
        assert torch.allclose(p - start[name], delta, atol=2e-6), name


def test_a_batch_mean_is_refused_at_its_first_backward_with_no_parameter_moved(tmp_path):
    def batch_mean(outputs, labels, num_items_in_batch=None):  # HF's fallback when no count is given
        return causal_lm_per_sample_loss(outputs, labels).mean()

    dp = trainer(tmp_path, without_dropout(tiny_gpt2(TOKENIZER)), lm_dataset(TOKENIZER, 6), batch_mean)
    start = trainable_copy(dp.model)
    with pytest.raises(PerSampleGradientError, match="mean over the batch dimension"):
        dp.train()
    assert all(torch.equal(p, start[name]) for name, p in dp.model.named_parameters())
