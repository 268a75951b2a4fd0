"""The private Trainer reads one PrivacyPlan: sampler, optimizer, budget, report and checkpoints.
Its sampling never repeats a draw across train() calls and, in secure mode, comes from the CSPRNG."""

import os

import pytest
import torch

import dptorch

pytest.importorskip("transformers")

from dptorch.integrations.hf import (  # noqa: E402
    PRIVACY_STATE_NAME,
    DataCollatorForPrivateCausalLanguageModeling,
    DPTrainer,
    PrivacyArguments,
)
from dptorch.optim.optimizer import DPOptimizer  # noqa: E402
from dptorch.plan import PrivacyPlan  # noqa: E402
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_gpt2, word_tokenizer  # noqa: E402

TOKENIZER = word_tokenizer()


class RowSpy:
    def __init__(self):
        self.collate = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER)
        self.rows = []

    def __call__(self, rows):
        self.rows.append(tuple(tuple(r["input_ids"]) for r in rows))
        return self.collate(rows)


def make_trainer(tmp_path, privacy, **args):
    torch.manual_seed(0)
    settings = dict(max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2, optim="sgd",
                    lr_scheduler_type="constant", learning_rate=0.05, max_grad_norm=0.0)
    settings.update(args)
    return DPTrainer(model=tiny_gpt2(TOKENIZER), args=cpu_training_args(str(tmp_path), **settings),
                     train_dataset=lm_dataset(TOKENIZER, 32), data_collator=RowSpy(), privacy_args=privacy)


def test_sampler_optimizer_budget_report_and_checkpoint_read_one_plan(tmp_path):
    trainer = make_trainer(tmp_path, PrivacyArguments(target_epsilon=2.0, target_delta=1e-3),
                           save_strategy="steps", save_steps=3)
    plan = trainer.privacy_plan
    assert isinstance(plan, PrivacyPlan) and trainer.privacy_budget.plan is plan
    assert plan.sample_rate == 8 / 32 and plan.steps_per_epoch == 4 and plan.planned_steps == 3
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, DPOptimizer) and optimizer.plan is plan
    sampler = trainer._dp_sampler.logical
    assert (sampler.sample_rate, sampler.steps) == (plan.sample_rate, plan.steps_per_epoch)
    assert plan.steps == 3 and 1.96 <= trainer.get_epsilon() <= 2.0
    report = trainer.privacy_report()
    assert report == {**plan.report(1e-3), "privacy_unit": "row", "num_units": 32, "grad_sample_mode": "bk",
                      "dptorch_version": dptorch.__version__}
    state = torch.load(os.path.join(tmp_path, "checkpoint-3", PRIVACY_STATE_NAME), weights_only=True)
    assert state["plan"]["steps"] == 3 and state["plan"]["sample_rate"] == plan.sample_rate


def test_a_second_train_call_draws_new_batches(tmp_path):
    trainer = make_trainer(tmp_path, PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, sampling_seed=7))
    trainer.train()
    first = list(trainer.data_collator.rows)
    trainer.data_collator.rows.clear()
    trainer.train()  # was: the same seed restarted epoch 0, training on the very same batches again
    assert trainer.data_collator.rows != first
    assert trainer.privacy_plan.steps == 6  # both runs are in the budget


def test_secure_mode_samples_from_the_csprng(tmp_path):
    with pytest.raises(ValueError, match="takes no sampling_seed"):
        PrivacyArguments(noise_multiplier=1.0, secure_mode=True, sampling_seed=3)
    runs = []
    for name in ("a", "b"):
        trainer = make_trainer(tmp_path / name, PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3,
                                                                 secure_mode=True))
        torch.manual_seed(0)
        trainer.train()
        assert trainer._dp_sampler.logical.secure
        runs.append(trainer.data_collator.rows)
    assert runs[0] != runs[1]


def test_a_subclass_that_builds_its_own_train_loader_is_refused(tmp_path):
    """A get_train_dataloader override that bypasses the Poisson sampler trains on batches the accounting
    never saw: refused at the first training step, before any parameter changes."""
    from torch.utils.data import DataLoader

    from dptorch.plan import SamplingMismatchError

    class OwnLoader(DPTrainer):
        def get_train_dataloader(self):
            return DataLoader(self.train_dataset, batch_size=4, collate_fn=self.data_collator)

    torch.manual_seed(0)
    trainer = OwnLoader(model=tiny_gpt2(TOKENIZER), args=cpu_training_args(str(tmp_path), max_steps=2, optim="sgd",
                                                                           per_device_train_batch_size=4),
                        train_dataset=lm_dataset(TOKENIZER, 32), data_collator=RowSpy(),
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(SamplingMismatchError, match="did not draw"):
        trainer.train()
    assert all(torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
