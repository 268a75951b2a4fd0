"""dp-transformers code renamed to ``dptorch.integrations.hf``: the fine-tune-dp.py script, the
aliases, ``OpacusDPTrainer``'s author mapping (user-level DP) and its epsilons.

Expected epsilons are computed here with ``dptorch.accounting`` for the settings the trainer
samples with: ``q = per_device_train_batch_size * gradient_accumulation_steps / number of
authors`` per step, one accounted step per optimizer step.
"""

import copy
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import dptorch.integrations.hf as hf  # noqa: E402
from dptorch.accounting import create_accountant, get_noise_multiplier  # noqa: E402
from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, PrivacyArguments  # noqa: E402
from dptorch.integrations.hf.dp_transformers_compat import units_from_author_mapping  # noqa: E402
from dptorch.grad_sample.units.per_sample_losses import causal_lm_per_sample_loss  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    clipped_unit_update,
    cpu_training_args,
    lm_dataset,
    tiny_gpt2,
    without_dropout,
    word_tokenizer,
)

from . import dp_transformers_fine_tune_dp as script  # noqa: E402

SCRIPT = Path(script.__file__)
TOKENIZER = word_tokenizer()
COLLATE = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER)


def epsilon_of(history, delta, accountant="pld"):
    counter = create_accountant(accountant)
    for sigma, q, steps in history:
        counter.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return counter.get_epsilon(delta)


def script_argv(tmp_path, *extra):
    return ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
            "--save_strategy", "no", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
            "--learning_rate", "0.01", "--lr_scheduler_type", "constant", "--logging_steps", "1",
            "--sequence_len", "16", "--log_level", "error", "--per_sample_max_grad_norm", "1.0",
            "--target_delta", "1e-3", *extra]


# ------------------------------------------------------------------ the script


def test_script_uses_only_dp_transformers_names_that_exist_after_the_rename():
    text = SCRIPT.read_text().split("'''", 2)[2]  # the code after the module docstring
    imports = re.findall(r"^(?:from|import) (dptorch[\w.]*)(.*)$", text, flags=re.MULTILINE)
    assert imports == [("dptorch.integrations.hf", " as dp_transformers")]  # the rename, and nothing else
    used = set(re.findall(r"\bdp_transformers((?:\.\w+)+)", text))
    assert {".TrainingArguments", ".PrivacyArguments", ".dp_utils.OpacusDPTrainer",
            ".dp_utils.create_author_mapping", ".DataCollatorForPrivateCausalLanguageModeling"} <= used
    for path in used:
        target = hf
        for name in path.strip(".").split("."):
            target = getattr(target, name)  # AttributeError: a dp-transformers name without an alias


def test_fine_tune_dp_script_trains_author_level_dp_and_logs_the_accountants_epsilon(tmp_path):
    trainer = script.run(script_argv(tmp_path, "--num_train_epochs", "6", "--target_epsilon", "8",
                                     "--eval_strategy", "epoch"))
    plan, history = trainer.privacy_plan, trainer.state.log_history
    eval_losses = [h["eval_loss"] for h in history if "eval_loss" in h]
    assert len(eval_losses) == 6 and eval_losses[-1] < eval_losses[0] - 0.2

    num_authors = len(trainer.author_mapping)
    assert plan.num_units == num_authors < len(trainer.train_dataset)  # authors, not rows, are the units
    q = 16 / num_authors
    assert plan.sample_rate == q
    steps = trainer.state.global_step
    assert plan.steps == steps == 6 * plan.steps_per_epoch
    sigma = get_noise_multiplier(target_epsilon=8, target_delta=1e-3, sample_rate=q, steps=steps, accountant="pld")
    assert trainer.noise_multiplier == sigma
    logged = [h["epsilon"] for h in history if "loss" in h]
    assert len(logged) == steps
    for step, epsilon in enumerate(logged, start=1):
        assert epsilon == pytest.approx(epsilon_of([(sigma, q, step)], 1e-3), rel=1e-9)
    assert 7.5 < logged[-1] <= 8
    final = history[-1]
    assert final["final_epsilon_rdp"] == pytest.approx(epsilon_of([(sigma, q, steps)], 1e-3, "rdp"), rel=1e-9)
    assert final["final_epsilon_prv"] == pytest.approx(epsilon_of([(sigma, q, steps)], 1e-3, "prv"), rel=1e-9)
    assert trainer.privacy_report()["privacy_unit"] == "author (author_mapping)"


def test_fine_tune_dp_script_with_lora_and_a_noise_multiplier(tmp_path):
    trainer = script.run(script_argv(tmp_path, "--num_train_epochs", "2", "--noise_multiplier", "1.0",
                                     "--enable_lora", "true", "--lora_dim", "4"))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    q, steps = trainer.privacy_plan.sample_rate, trainer.state.global_step
    assert steps == trainer.privacy_plan.steps > 0
    assert trainer.get_epsilon() == pytest.approx(epsilon_of([(1.0, q, steps)], 1e-3), rel=1e-9)
    assert trainer.get_rdp_epsilon() == pytest.approx(epsilon_of([(1.0, q, steps)], 1e-3, "rdp"), rel=1e-9)


# ------------------------------------------------------------------ OpacusDPTrainer and the author mapping


def users_dataset():
    return lm_dataset(TOKENIZER, 8).add_column("user", ["a", "b", "a", "c", "d", "b", "e", "a"])


def reference_update(model, dataset, units, clip, lr):
    """-lr * sum over units of clip(sum of the unit's row gradients) / number of units (noise 0, q = 1)."""
    rows = [[{"input_ids": dataset[int(row)]["input_ids"]} for row in unit] for unit in units]
    return clipped_unit_update(model, rows, COLLATE, causal_lm_per_sample_loss, clip, lr)


def opacus_dp_trainer(tmp_path, model, dataset, privacy, **kwargs):
    args = cpu_training_args(str(tmp_path), max_steps=1, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             optim="sgd", lr_scheduler_type="constant", learning_rate=0.05, max_grad_norm=0.0)
    return hf.dp_utils.OpacusDPTrainer(model=model, args=args, train_dataset=dataset, data_collator=COLLATE,
                                       privacy_args=privacy, **kwargs)


def test_author_mapping_clips_each_authors_rows_together(tmp_path):
    data = users_dataset()
    mapping = hf.dp_utils.create_author_mapping(data, "user")
    assert mapping == [[0, 2, 7], [1, 5], [3], [4], [6]]
    model = without_dropout(tiny_gpt2(TOKENIZER))
    trainer = opacus_dp_trainer(tmp_path, copy.deepcopy(model), data.remove_columns("user"),
                                PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=0.3, target_delta=1e-3),
                                author_mapping=mapping)
    assert trainer.sampling_plan.num_units == 5 and trainer.sampling_plan.sample_rate == 1.0
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    expected = reference_update(model, data, mapping, clip=0.3, lr=0.05)
    for (name, p), delta in zip(trainer.model.named_parameters(), expected):
        assert torch.allclose(p - start[name], delta, atol=2e-6), name


def test_without_author_mapping_every_row_is_its_own_unit(tmp_path):
    data = users_dataset().remove_columns("user")
    trainer = opacus_dp_trainer(tmp_path, tiny_gpt2(TOKENIZER), data,
                                PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3))
    assert trainer.sampling_plan.num_units == 8
    trainer.train()
    assert trainer.get_rdp_epsilon() == pytest.approx(epsilon_of([(1.0, 6 / 8, 1)], 1e-3, "rdp"), rel=1e-9)


@pytest.mark.parametrize("mapping, message", [
    ([[0, 2, 7], [1, 5], [3], [4]], "belong to no author"),
    ([[0, 2, 7], [1, 5, 2], [3], [4], [6]], "row 2 appears twice"),
    ([[0, 2, 7], [1, 5], [3], [4], [6], []], "no rows"),
    ([[0, 2, 7], [1, 5], [3], [4], [6, 8]], "outside"),
])
def test_author_mappings_that_do_not_partition_the_rows_are_refused(mapping, message):
    with pytest.raises(ValueError, match=message):
        units_from_author_mapping(mapping, 8)


def test_author_mapping_and_a_unit_column_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        opacus_dp_trainer(tmp_path, tiny_gpt2(TOKENIZER), users_dataset(),
                          PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, privacy_unit_column="user"),
                          author_mapping=[[i] for i in range(8)])


# ------------------------------------------------------------------ the other aliases


def test_dry_run_training_arguments_train_two_steps_and_log_every_step(tmp_path):
    args = hf.TrainingArguments(output_dir=str(tmp_path), dry_run=True, logging_steps=50, max_steps=100)
    assert args.max_steps == 2 and args.logging_steps == 1
    assert not hf.TrainingArguments(output_dir=str(tmp_path)).dry_run


def test_dp_transformers_names_without_a_counterpart_name_the_replacement():
    from dptorch.compat.opacus import OpacusCompatibilityError

    with pytest.raises(ImportError, match="author_mapping"):
        from dptorch.integrations.hf.dp_utils import ShuffledAuthorSampler  # noqa: F401
    with pytest.raises(OpacusCompatibilityError, match="get_noise_multiplier"):
        hf.dp_utils.find_noise_multiplier
    assert hf.register_grad_sampler_gpt2() is None and hf.register_grad_sampler_gpt2_lora() is None
    assert hf.PrivacyEngineCallback is hf.DPCallback and hf.dp_utils.PrivacyEngineCallback is hf.DPCallback
