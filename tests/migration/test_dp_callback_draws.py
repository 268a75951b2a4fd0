"""DPCallback on a plain Trainer whose loader draws from a dptorch Poisson sampler: one draw per step.

With ``gradient_accumulation_steps=2`` and a ``PoissonBatchSampler`` the Trainer summed two Poisson
draws into one noised step, accounted as one step of rate q (one row moved the clipped sum by 2 C).
Now a sampler that does not draw once per optimizer step is refused before training, and the draw
ledger the engine has checks every step of the callback too.
"""

import pytest
import torch

pytest.importorskip("transformers")

from torch.utils.data import DataLoader  # noqa: E402
from transformers import Trainer  # noqa: E402

from dptorch.accounting import create_accountant  # noqa: E402
from dptorch.data import PoissonBatchSampler  # noqa: E402
from dptorch.integrations.hf import (  # noqa: E402
    DataCollatorForPrivateCausalLanguageModeling,
    DPCallback,
    PoissonMicroBatchSampler,
    PrivacyArguments,
    PrivacyUnits,
)
from dptorch.plan import SamplingMismatchError  # noqa: E402
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_gpt2, word_tokenizer  # noqa: E402

TOKENIZER = word_tokenizer()
COLLATE = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER)
ROWS, Q = 16, 0.5


class PoissonLoaderTrainer(Trainer):
    """A plain Trainer whose train loader uses ``batch_sampler`` (a dptorch Poisson sampler)."""

    def __init__(self, *args, batch_sampler, collate=COLLATE, **kwargs):
        self._batch_sampler, self._collate = batch_sampler, collate
        super().__init__(*args, **kwargs)

    def get_train_dataloader(self):
        loader = DataLoader(self.train_dataset, batch_sampler=self._batch_sampler, collate_fn=self._collate)
        return self.accelerator.prepare(loader)


def trainer(tmp_path, batch_sampler, accumulation, collate=COLLATE, sigma=1.0):
    torch.manual_seed(0)
    callback = DPCallback(PrivacyArguments(noise_multiplier=sigma, target_delta=1e-3))
    args = cpu_training_args(str(tmp_path), max_steps=3, per_device_train_batch_size=4, optim="sgd",
                             gradient_accumulation_steps=accumulation, lr_scheduler_type="constant",
                             learning_rate=0.05, max_grad_norm=0.0)
    run = PoissonLoaderTrainer(model=tiny_gpt2(TOKENIZER), args=args, train_dataset=lm_dataset(TOKENIZER, ROWS),
                               data_collator=collate, callbacks=[callback], batch_sampler=batch_sampler,
                               collate=collate)
    return run, callback


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def unchanged(model, before):
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def epsilon_of(steps, q=Q, sigma=1.0):
    accountant = create_accountant("pld")
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_epsilon(1e-3)


def test_two_poisson_draws_summed_into_one_step_are_refused_before_training(tmp_path):
    run, callback = trainer(tmp_path, PoissonBatchSampler(ROWS, Q, steps=4, seed=1), accumulation=2)
    before = snapshot(run.model)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 sums 2 of them into one noised step.*2 C"):
        run.train()
    assert unchanged(run.model, before) and callback.plan.steps == 0


def test_a_micro_batch_sampler_that_deals_a_draw_over_other_step_counts_is_refused(tmp_path):
    sampler = PoissonMicroBatchSampler(PrivacyUnits.one_per_row(ROWS), Q, steps=4, micro_batches=3, seed=1)
    run, callback = trainer(tmp_path, sampler, accumulation=2)
    with pytest.raises(ValueError, match=r"deals each draw into 3 micro-batches.*micro_batches=2"):
        run.train()
    assert callback.plan.steps == 0


@pytest.mark.parametrize("kind", ["poisson-ga1", "micro-ga2"])
def test_one_draw_per_step_trains_each_step_checked_and_accounted_once(tmp_path, kind):
    if kind == "poisson-ga1":
        sampler, accumulation = PoissonBatchSampler(ROWS, Q, steps=4, seed=1), 1
    else:
        sampler = PoissonMicroBatchSampler(PrivacyUnits.one_per_row(ROWS), Q, steps=4, micro_batches=2, seed=1)
        accumulation = 2
    run, callback = trainer(tmp_path, sampler, accumulation=accumulation)
    run.train()
    plan = callback.plan
    assert plan.draws is not None and plan.draws.sizes == []  # every draw closed by its own step
    assert plan.steps == 3 and callback.get_epsilon() == pytest.approx(epsilon_of(3), rel=1e-12)
    logs = [h for h in run.state.log_history if "loss" in h]
    assert [h["epsilon"] for h in logs] == pytest.approx([epsilon_of(k) for k in (1, 2, 3)], rel=1e-12)
    assert sampler.listener is None  # detached at the end of training


def test_a_collator_that_adds_rows_to_a_draw_is_refused_by_the_ledger(tmp_path):
    """The callback's steps are held to the engine's rule: the backward passes see exactly the draw's rows."""

    def doubled(features):
        return COLLATE(list(features) + list(features))

    run, callback = trainer(tmp_path, PoissonBatchSampler(ROWS, Q, steps=4, seed=1), accumulation=1, collate=doubled)
    before = snapshot(run.model)
    with pytest.raises(SamplingMismatchError, match=r"saw (\d+) samples, but the DP data loader drew"):
        run.train()
    assert unchanged(run.model, before) and callback.plan.steps == 0
