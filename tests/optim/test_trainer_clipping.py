"""The private Trainer with adaptive / automatic clipping and clipping statistics (PrivacyArguments fields)."""

import pytest
import torch

pytest.importorskip("transformers")

from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments  # noqa: E402
from tests.helpers import single_thread  # noqa: E402,F401  (autouse)
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_gpt2, word_tokenizer  # noqa: E402

TOKENIZER = word_tokenizer()


def train(tmp_path, privacy):
    torch.manual_seed(0)
    args = cpu_training_args(str(tmp_path), max_steps=3, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             optim="sgd", lr_scheduler_type="constant", learning_rate=0.05, max_grad_norm=0.0)
    trainer = DPTrainer(model=tiny_gpt2(TOKENIZER), args=args, train_dataset=lm_dataset(TOKENIZER, 64),
                        data_collator=DataCollatorForPrivateCausalLanguageModeling(TOKENIZER), privacy_args=privacy)
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_adapts_the_bound_logs_it_and_accounts_the_stated_sigma(tmp_path):
    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, clipping="adaptive", per_sample_max_grad_norm=0.01,
                               noise_seed=0, sampling_seed=0,
                               target_unclipped_quantile=0.5, clipbound_learning_rate=1.0, unclipped_num_std=2.0,
                               clipping_stats="private")
    trainer, logs = train(tmp_path, privacy)
    plan = trainer.privacy_plan
    bounds = [entry["per_sample_max_grad_norm"] for entry in logs]
    assert len(bounds) == 3 and bounds[0] > 0.01 and bounds == sorted(bounds)  # tiny start: every unit clipped, C grows
    assert plan.max_grad_norm == bounds[-1] and plan.accountant.history == [[1.0, 0.25, 3]]
    assert plan.gradient_noise_multiplier == pytest.approx((1 - 4.0**-2) ** -0.5)
    assert all(0 <= entry["clipped_fraction"] <= 1 for entry in logs) and not any("raw_" in k for k in logs[0])
    assert trainer.privacy_report()["adaptive_clipping"]["initial_max_grad_norm"] == 0.01


def test_trainer_raw_statistics_are_off_by_default_and_prefixed_when_on(tmp_path):
    _, logs = train(tmp_path / "default", PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3))
    assert not any("clipped" in k or "norm_p" in k for k in logs[0])
    trainer, logs = train(tmp_path / "raw", PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, clipping="automatic",
                                                             clipping_gamma=0.1, clipping_stats="raw"))
    assert {"raw_units", "raw_norm_p50", "raw_norm_max"} <= set(logs[0]) and "raw_clipped_fraction" not in logs[0]
    assert trainer.privacy_plan.noise_std == 1.0 and trainer.privacy_plan.gamma == 0.1
    with pytest.raises(ValueError, match="gamma"):
        PrivacyArguments(noise_multiplier=1.0, clipping_gamma=0.1)
