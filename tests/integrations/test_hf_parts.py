"""The HF integration's parts without a Trainer: arguments, units, sampling, collator, losses, budget."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import HfArgumentParser, TrainingArguments  # noqa: E402

from dptorch.integrations.hf import (  # noqa: E402
    DataCollatorForPrivateCausalLanguageModeling,
    EmptyBatch,
    PoissonMicroBatchSampler,
    PrivacyArguments,
    PrivacyBudget,
    PrivacyUnits,
    SamplingPlan,
    causal_lm_per_sample_loss,
)
from dptorch.integrations.hf.sampling import UNIT_IDS_KEY, IndexedDataset, PrivateCollate  # noqa: E402
from tests.integrations.tiny import tiny_gpt2, without_dropout, word_tokenizer  # noqa: E402

# ---------------------------------------------------------------------------------------- arguments


def test_arguments_parse_next_to_training_arguments():
    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    training, privacy = parser.parse_args_into_dataclasses(
        ["--output_dir", "out", "--max_grad_norm", "0", "--noise_multiplier", "0.8", "--per_sample_max_grad_norm", "0.5",
         "--privacy_unit_column", "user", "--accountant", "RDP"]
    )
    assert training.max_grad_norm == 0 and privacy.per_sample_max_grad_norm == 0.5
    assert privacy.noise_multiplier == 0.8 and privacy.privacy_unit_column == "user" and privacy.accountant == "rdp"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of noise_multiplier"),
        (dict(noise_multiplier=1.0, target_epsilon=3.0), "exactly one of noise_multiplier"),
        (dict(noise_multiplier=-1.0), "noise_multiplier must be"),
        (dict(noise_multiplier=1.0, target_delta=1.5), "target_delta"),
        (dict(noise_multiplier=1.0, per_sample_max_grad_norm=0), "per_sample_max_grad_norm"),
        (dict(noise_multiplier=1.0, poisson_sampling=False), "poisson_sampling=False is refused"),
        (dict(noise_multiplier=1.0, grad_sample_mode="twopass"), "grad_sample_mode must be one of"),
        (dict(noise_multiplier=1.0, accountant="moments"), "accountant must be one of"),
        (dict(noise_multiplier=1.0, secure_mode=True, noise_seed=3), "secure_mode"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrivacyArguments(**kwargs)


def test_budget_cap_defaults_to_target_epsilon():
    assert PrivacyArguments(target_epsilon=3.0).budget_cap == 3.0
    assert PrivacyArguments(target_epsilon=3.0, max_epsilon=2.0).budget_cap == 2.0
    assert PrivacyArguments(noise_multiplier=1.0).budget_cap is None

# ---------------------------------------------------------------------------------------- units and sampling


def test_units_group_rows_by_column_value():
    units = PrivacyUnits.from_values(["ann", "bob", "ann", "cid", "bob", "ann"])
    assert units.num_units == 3 and units.num_rows == 6 and not units.trivial
    assert units.rows_of([0]) == [0, 2, 5] and units.rows_of([2, 1]) == [3, 1, 4]
    assert units.largest_unit() == 3
    from_items = PrivacyUnits.from_dataset([{"u": 7}, {"u": 8}, {"u": 7}], "u")
    assert from_items.rows_of([0]) == [0, 2] and from_items.num_units == 2
    with pytest.raises(ValueError, match="no key 'user'"):
        PrivacyUnits.from_dataset([{"u": 7}], "user")


def test_plan_matches_the_trainers_step_arithmetic():
    plan = SamplingPlan.for_training(num_units=100, batch_size=4, gradient_accumulation_steps=3, max_steps=-1, num_train_epochs=2)
    assert plan.sample_rate == pytest.approx(12 / 100) and plan.expected_batch_size == pytest.approx(12)
    assert plan.steps_per_epoch == 9 and plan.total_steps == 18 and plan.micro_batches == 3


def test_micro_batches_split_each_logical_batch_and_keep_units_whole():
    units = PrivacyUnits.from_values([i // 3 for i in range(60)])  # 20 units of 3 rows
    sampler = PoissonMicroBatchSampler(units, 0.3, steps=50, micro_batches=4, seed=7)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 200
    sizes = []
    for step in range(50):
        group = batches[4 * step : 4 * step + 4]
        rows = [r for b in group for r in b]
        assert len(rows) == len(set(rows))
        for b in group:
            assert len(b) % 3 == 0 and all(units.unit_of_row[b[i]] == units.unit_of_row[b[i + 1]] for i in range(0, len(b), 3))
        per_micro = [len(b) // 3 for b in group]
        assert max(per_micro) - min(per_micro) <= 1  # dealt evenly
        sizes.append(sum(per_micro))
    assert abs(np.mean(sizes) - 6) < 1.2  # q * 20 units
    assert any(len(b) == 0 for b in batches)  # empty micro-batches happen, and are yielded


def test_sampling_replays_an_epoch_from_its_seed():
    units = PrivacyUnits.one_per_row(30)
    first = PoissonMicroBatchSampler(units, 0.2, steps=5, micro_batches=2, seed=11)
    second = PoissonMicroBatchSampler(units, 0.2, steps=5, micro_batches=2, seed=11)
    first.set_epoch(3)
    second.set_epoch(3)
    second.set_epoch(3)  # idempotent, as the Trainer calls it twice
    assert list(first) == list(second)
    other = PoissonMicroBatchSampler(units, 0.2, steps=5, micro_batches=2, seed=12)
    other.set_epoch(3)
    assert list(other) != list(first)
    assert not hasattr(first, "sampler")  # Accelerate must not swap it


def test_collate_turns_empty_batches_into_the_sentinel_and_tags_units():
    collate = PrivateCollate(lambda items: {"x": torch.tensor(items)}, unit_of_row=np.array([5, 5, 6, 7]))
    assert isinstance(collate([]), EmptyBatch) and len(collate([])) == 0
    dataset = IndexedDataset([10, 11, 12, 13])
    batch = collate(dataset.__getitems__([0, 1, 3]))
    assert batch["x"].tolist() == [10, 11, 13] and batch[UNIT_IDS_KEY].tolist() == [5, 5, 7]

# ---------------------------------------------------------------------------------------- collator


@pytest.mark.parametrize("side", ["right", "left"])
def test_collator_pads_and_builds_labels_and_positions(side):
    tokenizer = word_tokenizer()
    tokenizer.padding_side = side
    collate = DataCollatorForPrivateCausalLanguageModeling(tokenizer)
    eos = tokenizer.eos_token_id
    batch = collate([{"input_ids": [7, 8, 9, eos]}, {"input_ids": [7, eos]}, [5, 6, 7]])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (3, 4)
    short = 1
    mask = batch["attention_mask"][short]
    assert mask.tolist() == ([1, 1, 0, 0] if side == "right" else [0, 0, 1, 1])
    real = mask.bool()
    assert batch["labels"][short][real].tolist() == [7, eos]  # the real EOS is learned even though it is not padding
    assert (batch["labels"][short][~real] == -100).all()
    assert batch["position_ids"][short][real].tolist() == [0, 1]  # positions count from the first real token
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3]


def test_collator_keeps_given_labels_and_rounds_length():
    collate = DataCollatorForPrivateCausalLanguageModeling(word_tokenizer(), pad_to_multiple_of=8)
    batch = collate([{"input_ids": [4, 5, 6], "labels": [-100, 5, 6]}])
    assert batch["labels"].tolist() == [[-100, 5, 6] + [-100] * 5]
    with pytest.raises(ValueError, match="empty batch"):
        collate([])

# ---------------------------------------------------------------------------------------- losses


def test_causal_loss_is_each_rows_own_token_mean():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[1, 2, 3, 4, 5], [1, 2, -100, -100, -100]])
    losses = causal_lm_per_sample_loss({"logits": logits}, labels)
    alone = torch.nn.functional.cross_entropy(logits[1, :1], labels[1, 1:2])
    assert losses.shape == (2,) and torch.allclose(losses[1], alone)


def test_a_samples_gradient_does_not_depend_on_the_other_samples():
    """HF's batch-token normalisation would change row 0's gradient when row 1 grows; ours must not."""
    from dptorch.grad_sample import GradSampleHooks

    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    model = without_dropout(tiny_gpt2(tokenizer)).train()
    collate = DataCollatorForPrivateCausalLanguageModeling(tokenizer)
    first = {"input_ids": [5, 6, 7, 8]}
    grads = []
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        for other in ([9, 10], [11, 12, 13, 14, 15, 16, 17, 18]):
            batch = collate([first, {"input_ids": other}])
            labels = batch.pop("labels")
            causal_lm_per_sample_loss(model(**batch), labels).sum().backward()
            grads.append({p: g[0].clone() for p, g in hooks.grad_samples.items()})
            hooks.clear()
            model.zero_grad()
    for p in grads[0]:
        assert torch.allclose(grads[0][p], grads[1][p], atol=1e-6), hooks.parameter_name(p)

# ---------------------------------------------------------------------------------------- budget


def test_budget_stops_before_the_cap():
    budget = PrivacyBudget(accountant="rdp", noise_multiplier=1.0, sample_rate=0.1, delta=1e-5)
    eps = [budget.epsilon_after(k) for k in (10, 11)]
    capped = PrivacyBudget(accountant="rdp", noise_multiplier=1.0, sample_rate=0.1, delta=1e-5, cap=(eps[0] + eps[1]) / 2)
    assert capped.steps_within_cap(50) == 10
    assert capped.steps_within_cap(5) == 5
    for _ in range(10):
        capped.record_step()
    assert capped.steps_within_cap(50) == 0 and capped.epsilon() == pytest.approx(eps[0])


def test_zero_noise_is_infinite_epsilon():
    budget = PrivacyBudget(accountant="pld", noise_multiplier=0.0, sample_rate=0.1, delta=1e-5)
    assert budget.epsilon() == 0.0
    budget.record_step()
    assert math.isinf(budget.epsilon()) and budget.steps == 1
