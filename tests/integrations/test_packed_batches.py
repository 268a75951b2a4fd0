"""The private Trainer's batches must be the drawn examples: one per row, or packed with per-token units."""

import pytest
import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening

from dptorch.integrations.hf import DPTrainer, PrivacyArguments
from dptorch.grad_sample.units.per_sample_losses import causal_lm_per_sample_loss
from dptorch.integrations.hf.sampling import UNIT_IDS_KEY, PrivateCollate
from tests.integrations.test_hf_trainer import TOKENIZER
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_llama, without_dropout

PRIVACY = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, sampling_seed=2, grad_sample_mode="hooks")


def trainer(tmp_path, collator, model=None, **kwargs):
    torch.manual_seed(0)
    return DPTrainer(model=model or tiny_llama(TOKENIZER), train_dataset=lm_dataset(TOKENIZER, 32),
                     args=cpu_training_args(str(tmp_path), max_steps=2, per_device_train_batch_size=6),
                     data_collator=collator, privacy_args=PRIVACY, **kwargs)


def test_a_flattening_collator_trains_each_example_as_its_own_unit(tmp_path):
    """transformers' DataCollatorWithFlattening puts the drawn examples in one row with position_ids restarting at
    0: each example becomes a token unit and gets the gradient it has alone (before, the row was one unit)."""
    model = without_dropout(tiny_llama(TOKENIZER))
    dp = trainer(tmp_path, DataCollatorWithFlattening(), model=model)
    batch = next(iter(dp.get_train_dataloader()))
    units = batch[UNIT_IDS_KEY]
    assert batch["input_ids"].shape[0] == 1 and int(units.max()) + 1 >= 3
    examples = [(batch["input_ids"][units == u], batch["labels"][units == u]) for u in range(int(units.max()) + 1)]
    dp.training_step(model, batch)
    per_unit = {n: dp.dp_hooks.grad_samples[p].clone() for n, p in model.named_parameters()}
    reference = tiny_llama(TOKENIZER)
    reference.load_state_dict(model.state_dict())
    params = dict(reference.named_parameters())
    for u, (ids, labels) in enumerate(examples):
        reference.zero_grad()
        causal_lm_per_sample_loss(reference(input_ids=ids[None], use_cache=False), labels[None]).sum().backward()
        for name, g in per_unit.items():
            torch.testing.assert_close(g[u], params[name].grad, rtol=1e-4, atol=1e-6)


def test_a_collator_that_merges_examples_without_saying_which_tokens_are_whose_is_refused():
    def merge(items):  # all drawn examples in one row, positions running on
        ids = torch.cat([torch.as_tensor(i["input_ids"]) for i in items])[None]
        return {"input_ids": ids, "labels": ids.clone()}

    items = [{"input_ids": [3, 4, 5]}, {"input_ids": [6, 7]}]
    with pytest.raises(ValueError, match="turned 2 drawn examples into 1 rows"):
        PrivateCollate(merge)(items)
    assert PrivateCollate(merge)(items[:1])["input_ids"].shape == (1, 3)  # one example, one row: fine


def test_a_per_row_loss_function_is_refused_on_packed_rows(tmp_path):
    dp = trainer(tmp_path, DataCollatorWithFlattening(), per_sample_loss_func=causal_lm_per_sample_loss)
    with pytest.raises(ValueError, match="per_sample_loss_func sees rows, but this batch packs several examples"):
        dp.train()


def test_padded_rows_stay_row_units(tmp_path):
    dp = trainer(tmp_path, DataCollatorForLanguageModeling(TOKENIZER, mlm=False))
    batch = next(iter(dp.get_train_dataloader()))
    assert UNIT_IDS_KEY not in batch
