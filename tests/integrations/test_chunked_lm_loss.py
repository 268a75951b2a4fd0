"""ChunkedCausalLMLoss in the private Trainer and through make_private: each step equals the batch-of-one
reference computed from the full logits; what it cannot prove is refused before any step."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from dptorch.grad_sample.layers.chunked_lm_head import ChunkedLMHead  # noqa: E402
from dptorch.grad_sample.units.chunked_lm_loss import ChunkedCausalLMLoss  # noqa: E402
from dptorch.integrations.hf import (  # noqa: E402
    DataCollatorForPrivateCausalLanguageModeling,
    DPTrainer,
    PrivacyArguments,
    causal_lm_per_sample_loss,
)
from tests.helpers import single_thread  # noqa: F401,E402
from tests.integrations.tiny import (  # noqa: E402
    clipped_unit_update,
    cpu_training_args,
    lm_dataset,
    tiny_gpt2,
    tiny_llama,
    trainable_copy,
    without_dropout,
    word_tokenizer,
)

TOKENIZER = word_tokenizer()
COLLATE = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER)
BLOCK = 64  # a few words per block: the vocabulary is split in many


def chunked_trainer(tmp_path, model, data, mode, **args):
    """One noiseless step at q = 1 (two micro-batches) with the chunked loss."""
    return DPTrainer(
        model=model, args=cpu_training_args(str(tmp_path), max_steps=1, per_device_train_batch_size=3,
                                            gradient_accumulation_steps=2, optim="sgd", learning_rate=0.05,
                                            lr_scheduler_type="constant", max_grad_norm=0.0, **args),
        train_dataset=data, data_collator=COLLATE, per_sample_loss_func=ChunkedCausalLMLoss(block_elements=BLOCK),
        privacy_args=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=0.3, target_delta=1e-3,
                                      grad_sample_mode=mode),
    )


@pytest.mark.parametrize("build, mode", [(tiny_llama, "hooks"), (tiny_llama, "bk"), (tiny_gpt2, "ghost")])
def test_a_trainer_step_equals_the_full_logits_batch_of_one_reference(tmp_path, build, mode):
    """tiny_llama: untied head; tiny_gpt2: head tied to the token embedding (the sum of its two uses)."""
    data = lm_dataset(TOKENIZER, 6)
    torch.manual_seed(0)
    model = without_dropout(build(TOKENIZER))
    trainer = chunked_trainer(tmp_path, copy.deepcopy(model), data, mode)
    head = trainer.model.get_output_embeddings()
    assert isinstance(head, ChunkedLMHead)
    assert (head.weight is trainer.model.get_input_embeddings().weight) == (build is tiny_gpt2)  # tied stays tied
    start = trainable_copy(trainer.model)
    trainer.train()
    expected = clipped_unit_update(model, [[{"input_ids": row["input_ids"]}] for row in data], COLLATE,
                                   causal_lm_per_sample_loss, 0.3, 0.05)
    for (name, p), delta in zip(trainer.model.named_parameters(), expected):
        assert torch.allclose(p - start[name], delta, atol=2e-6), name
    plain = copy.deepcopy(model)
    plain.load_state_dict(trainer.model.state_dict())  # the same keys: the head keeps its weight's name
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():  # evaluation and generation: the logits, as a plain head gives them
        torch.testing.assert_close(trainer.model.eval()(input_ids=ids).logits, plain.eval()(input_ids=ids).logits)


def test_make_private_with_its_loader_steps_as_the_reference():
    from torch.utils.data import DataLoader

    from dptorch import PrivacyEngine

    data = lm_dataset(TOKENIZER, 6)
    rows = [COLLATE([row]) for row in data]
    torch.manual_seed(0)
    model = without_dropout(tiny_llama(TOKENIZER))
    private_model = copy.deepcopy(model)
    loss = ChunkedCausalLMLoss(block_elements=BLOCK)
    loss.install(private_model)  # before make_private: the controller hooks the head
    length = max(r["input_ids"].shape[1] for r in rows)
    ids = torch.full((len(rows), length), TOKENIZER.pad_token_id)
    labels = torch.full((len(rows), length), -100)
    for i, r in enumerate(rows):
        ids[i, : r["input_ids"].shape[1]] = r["input_ids"][0]
        labels[i, : r["labels"].shape[1]] = r["labels"][0]
    loader = DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=len(rows))
    optimizer = torch.optim.SGD(private_model.parameters(), lr=0.05)
    engine = PrivacyEngine()
    private_model, optimizer, loader = engine.make_private(
        module=private_model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=0.3,
        poisson_sampling=False, loss_reduction="sum", grad_sample_mode="bk")
    start = trainable_copy(private_model)
    for batch_ids, batch_labels in loader:
        losses, _ = loss(private_model, {"input_ids": batch_ids, "attention_mask": batch_ids != TOKENIZER.pad_token_id},
                         batch_labels)
        losses.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    # loss_reduction="sum": the step is -lr times the clipped sum (the reference divides it by the rows)
    reference = clipped_unit_update(model, [[{"input_ids": row["input_ids"]}] for row in data], COLLATE,
                                    causal_lm_per_sample_loss, 0.3, 0.05 * len(rows))
    for (name, p), delta in zip(private_model.named_parameters(), reference):
        assert torch.allclose(p - start[name], delta, atol=2e-6), name


def test_a_model_that_transforms_its_logits_is_refused_before_any_step(tmp_path):
    model = tiny_llama(TOKENIZER)
    original = model.forward

    def scaled(*args, **kwargs):
        outputs = original(*args, **kwargs)
        outputs.logits = outputs.logits * 0.5  # a logit scale, as some models apply
        return outputs

    model.forward = scaled
    with pytest.raises(ValueError, match="not its LM head's output"):
        chunked_trainer(tmp_path, model, lm_dataset(TOKENIZER, 6), "bk")
    assert not isinstance(model.get_output_embeddings(), ChunkedLMHead)


def test_label_smoothing_and_a_model_that_is_no_causal_lm_are_refused(tmp_path):
    with pytest.raises(ValueError, match="label smoothing"):
        chunked_trainer(tmp_path, tiny_llama(TOKENIZER), lm_dataset(TOKENIZER, 6), "bk", label_smoothing_factor=0.1)
    from tests.integrations.tiny import tiny_t5

    with pytest.raises(ValueError, match="causal LM's loss"):
        chunked_trainer(tmp_path, tiny_t5(TOKENIZER), lm_dataset(TOKENIZER, 6), "bk")


def test_a_head_installed_after_make_private_is_refused_before_any_update():
    """The controller hooked the model's layers when it attached: a head put in afterwards is a module it does not
    see, whose weight would get a gradient without per-sample gradients. Install the loss first."""
    from torch.utils.data import DataLoader

    from dptorch import PrivacyEngine
    from dptorch.grad_sample import PerSampleGradientError

    torch.manual_seed(0)
    model = without_dropout(tiny_llama(TOKENIZER))
    ids = torch.randint(3, 20, (4, 6))
    loader = DataLoader(torch.utils.data.TensorDataset(ids, ids.clone()), batch_size=4)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=0.3, poisson_sampling=False, loss_reduction="sum")
    loss = ChunkedCausalLMLoss(block_elements=BLOCK)
    loss.install(model._module if hasattr(model, "_module") else model)
    start = trainable_copy(model)
    try:
        with pytest.raises(PerSampleGradientError):
            for batch_ids, batch_labels in loader:
                losses, _ = loss(model, {"input_ids": batch_ids}, batch_labels)
                losses.sum().backward()
                optimizer.step()
    finally:
        engine.detach()
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters() if n in start)
