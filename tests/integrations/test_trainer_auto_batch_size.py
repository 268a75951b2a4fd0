"""``auto_find_batch_size`` in the private Trainer: passes of fewer units after an out-of-memory error, with the
Poisson draws, the steps, the noise and epsilon of the run without it.

A CPU cannot run out of memory safely, so a layer of the model raises what a GPU raises
(``torch.OutOfMemoryError("CUDA out of memory. ...")``, which ``accelerate.utils.should_reduce_batch_size``, the
test transformers' own search uses, calls one) when a pass holds more rows than a limit: in its forward, or in
its backward (a full backward pre-hook, after the forward's capture).
"""

import logging

import pytest
import torch

pytest.importorskip("transformers")

from transformers.utils import logging as hf_logging  # noqa: E402

from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments  # noqa: E402
from dptorch.integrations.hf.checks import setup_problems  # noqa: E402
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_gpt2, trainable_copy, word_tokenizer  # noqa: E402

TOKENIZER = word_tokenizer()
COLLATE = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER)


class ObservedTrainer(DPTrainer):
    """Records the rows of every micro-batch the Poisson sampler dealt (unpadded ids)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        if inputs:
            self.seen.append([row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])])
        else:
            self.seen.append([])
        return super().training_step(model, inputs, num_items_in_batch)


def out_of_memory(rows):
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate the activations of {rows} rows (simulated)")


def memory_limit(model, rows, where):
    """Make the first block raise an out-of-memory error, in its forward or its backward, for more than ``rows``
    rows; returns the passes it saw (their row counts)."""
    passes = []
    block = model.transformer.h[0]

    def forward(module, args):
        passes.append(args[0].shape[0])
        if where == "forward" and args[0].shape[0] > rows:
            raise out_of_memory(args[0].shape[0])

    def backward(module, grad_output):
        if grad_output[0].shape[0] > rows:
            raise out_of_memory(grad_output[0].shape[0])

    block.register_forward_pre_hook(forward)
    if where == "backward":
        block.register_full_backward_pre_hook(backward)
    return passes


def run(tmp_path, *, limit=None, where="forward", steps=3, **args):
    torch.manual_seed(0)
    model = tiny_gpt2(TOKENIZER)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    passes = memory_limit(model, limit, where) if limit is not None else []
    training = cpu_training_args(str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, optim="sgd", learning_rate=0.5,
                                 lr_scheduler_type="constant", max_grad_norm=0.0, **args)
    trainer = ObservedTrainer(model=model, args=training, train_dataset=lm_dataset(TOKENIZER, 32), data_collator=COLLATE,
                              privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, sampling_seed=3,
                                                            noise_seed=4, per_sample_max_grad_norm=0.5))
    before = trainable_copy(model)
    trainer.train()
    return trainer, before, passes


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_passes_shrink_after_an_out_of_memory_error_and_the_run_is_the_one_without(tmp_path, where, caplog):
    plain, start, _ = run(tmp_path / "plain")
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING, logger="dptorch.integrations.hf.physical_batches"):
            searched, _, passes = run(tmp_path / "searched", limit=2, where=where, auto_find_batch_size=True)
    finally:
        hf_logging.disable_propagation()
    # the same Poisson draws, dealt into the same micro-batches, and the same accounting
    assert searched.seen == plain.seen and sum(map(len, plain.seen)) > 0
    assert max(map(len, plain.seen)) > 2  # some micro-batch had to be cut
    assert searched.privacy_plan.sample_rate == plain.privacy_plan.sample_rate == 8 / 32
    assert searched.privacy_budget.steps == plain.privacy_budget.steps == 3
    assert searched.get_epsilon() == plain.get_epsilon()
    assert searched._dp_physical.cap == 2 and max(p for p in passes if p <= 2) == 2
    assert searched.args.auto_find_batch_size and searched._train_batch_size == 4  # HF's own search never ran
    assert "at most 2 units run per pass" in caplog.text and "epsilon are unchanged" in caplog.text
    # every unit clipped and added once, the same noise: the parameters of the run without the search
    got, expected = trainable_copy(searched.model), trainable_copy(plain.model)
    moved = max(float((expected[n] - start[n]).abs().max()) for n in expected)
    assert moved > 0.1  # the noise and the clipped sums moved the weights far beyond the tolerance below
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_unit_that_does_not_fit_alone_stops_training_before_any_step(tmp_path):
    with pytest.raises(RuntimeError, match="one privacy unit alone does not fit") as caught:
        run(tmp_path, limit=0, auto_find_batch_size=True)
    assert not isinstance(caught.value, torch.OutOfMemoryError)  # not an error transformers' search would retry


def test_without_auto_find_batch_size_the_error_reaches_the_caller(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        run(tmp_path, limit=2)


def test_an_out_of_memory_error_in_the_dp_optimizers_clipping_is_not_retried(tmp_path):
    """An error from the end-of-round listeners (where the DP optimizer clips and adds) comes after the pass may have
    been added in part: running it again could add a unit twice, so the search stops instead."""
    torch.manual_seed(0)
    training = cpu_training_args(str(tmp_path), max_steps=1, per_device_train_batch_size=4, auto_find_batch_size=True)
    trainer = DPTrainer(model=tiny_gpt2(TOKENIZER), args=training, train_dataset=lm_dataset(TOKENIZER, 32),
                        data_collator=COLLATE, privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3))

    def after_clipping(hooks):
        raise out_of_memory(hooks.batch_size)

    trainer.create_optimizer()  # the DP optimizer listens first; this listener runs after it
    trainer.dp_hooks.add_backward_listener(after_clipping)
    with pytest.raises(RuntimeError, match="cannot run again"):
        trainer.train()


def test_several_processes_are_refused_with_the_reason():
    from tests.distributed.test_parts import fake_trainer

    privacy = PrivacyArguments(noise_multiplier=1.0)
    assert setup_problems(fake_trainer(auto_find_batch_size=True), privacy) == []
    problems = setup_problems(fake_trainer(auto_find_batch_size=True, world_size=2), privacy)
    assert len(problems) == 1 and "every rank must run the same passes" in problems[0]
