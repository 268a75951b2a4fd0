"""NEFTune in the private Trainer: embedding noise scaled by each sample's own length, exact per-sample gradients.

transformers' hook scales the noise by the padded batch length, so a sample's noise depends on the longest
sample drawn with it; the private variant (``dptorch.integrations.hf.neftune``) scales row ``i`` by its own
token count ``L_i`` and the width ``d``: ``alpha / sqrt(L_i d)``, noise on its tokens only.
"""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainerCallback  # noqa: E402
from transformers.integrations.neftune import neftune_post_forward_hook  # noqa: E402

from dptorch.grad_sample import GradSampleHooks  # noqa: E402
from dptorch.grad_sample.units.per_sample_losses import causal_lm_per_sample_loss  # noqa: E402
from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments  # noqa: E402
from dptorch.integrations.hf.neftune import PrivateNEFTune, neftune_noise, neftune_scale  # noqa: E402
from tests.integrations.tiny import (cpu_training_args, lm_dataset, tiny_gpt2, trainable_copy, without_dropout,  # noqa: E402
                                     word_tokenizer)

TOKENIZER = word_tokenizer()
COLLATE = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER)
ALPHA = 5.0


def mask(*lengths, width):
    return torch.tensor([[1] * n + [0] * (width - n) for n in lengths])


def test_a_rows_scale_is_its_own_length_and_width_whatever_the_others():
    alone = neftune_scale(mask(3, width=3), 32, ALPHA)
    short = neftune_scale(mask(3, 5, width=5), 32, ALPHA)
    long = neftune_scale(mask(3, 11, 2, width=11), 32, ALPHA)
    assert alone[0] == short[0] == long[0] == pytest.approx(ALPHA / (3 * 32) ** 0.5, rel=1e-6)
    assert short[1] == pytest.approx(ALPHA / (5 * 32) ** 0.5, rel=1e-6)


def test_noise_lies_on_the_rows_tokens_within_its_scale():
    torch.manual_seed(0)
    m = mask(4, 9, width=9)
    embeddings = torch.zeros(2, 9, 64)
    noise = neftune_noise(embeddings, m, ALPHA)
    scale = neftune_scale(m, 64, ALPHA)
    assert torch.all(noise[0, 4:] == 0) and torch.all(noise[0, :4] != 0)
    for row in range(2):
        ratio = noise[row, : int(m[row].sum())].abs().max() / scale[row]
        assert 0.95 < ratio <= 1.0  # uniform on (-s_i, s_i): 256 or more draws reach past 0.95 s_i


def batch_of(rows):
    return COLLATE([{"input_ids": r} for r in rows])


def per_sample_grads(model, batch, hook, seed=0):
    """Per-sample gradients (hooks mode) of the summed causal LM loss of ``batch`` with ``hook`` adding noise."""
    model = copy.deepcopy(model).train()
    handle = hook(model)
    hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode="hooks")
    labels = batch.pop("labels")
    torch.manual_seed(seed)
    causal_lm_per_sample_loss(model(**batch), labels).sum().backward()
    grads = {name: p.grad_sample.clone() for name, p in model.named_parameters() if hasattr(p, "grad_sample")}
    hooks.cleanup()
    handle()
    return grads


def private_neftune(model):
    neftune = PrivateNEFTune(ALPHA)
    neftune.follow(model)
    return neftune.remove


def hf_neftune(model):
    embedding = model.get_input_embeddings()
    embedding.neftune_noise_alpha = ALPHA
    return embedding.register_forward_hook(neftune_post_forward_hook).remove


def test_a_samples_gradient_does_not_depend_on_the_others_length():
    """Row 0 first, with the same seed: its noise draws are the stream's first L_0 d values in both batches, and
    with its own scale its per-sample gradient is the same whether the other row is short or long. transformers'
    hook scales row 0 by the padded length, and its gradient moves with the other row's length."""
    torch.manual_seed(1)
    model = without_dropout(tiny_gpt2(TOKENIZER))
    rows = lm_dataset(TOKENIZER, 40)["input_ids"]
    first = min(rows, key=len)
    other_short, other_long = sorted((r for r in rows if r is not first), key=len)[0], max(rows, key=len)
    assert len(other_short) < len(other_long)
    short, long = batch_of([first, other_short]), batch_of([first, other_long])
    for hook, same in ((private_neftune, True), (hf_neftune, False)):
        a = per_sample_grads(model, dict(short), hook)
        b = per_sample_grads(model, dict(long), hook)
        gaps = [(a[n][0] - b[n][0]).abs().max() / a[n][0].abs().max() for n in a]
        assert (max(gaps) < 1e-5) == same, (hook.__name__, max(gaps))


def test_per_sample_gradients_equal_the_batch_of_one_reference_under_the_same_noise():
    """The controller's per-sample gradients of a NEFTune forward are each row alone through the model with the
    noise that row got (the stream's values, replayed on a plain hook): the noise is per-row input data."""
    torch.manual_seed(2)
    model = without_dropout(tiny_gpt2(TOKENIZER))
    rows = lm_dataset(TOKENIZER, 3)["input_ids"]
    batch = batch_of(rows)
    got = per_sample_grads(model, dict(batch), private_neftune, seed=5)
    width = model.config.n_embd
    torch.manual_seed(5)
    unit = torch.empty(batch["input_ids"].shape + (width,)).uniform_(-1.0, 1.0)  # the hook's draw
    for i, row in enumerate(rows):
        alone = batch_of([row])
        noise = unit[i : i + 1, : len(row)] * neftune_scale(alone["attention_mask"], width, ALPHA)
        reference = copy.deepcopy(model).train()
        handle = reference.get_input_embeddings().register_forward_hook(lambda m, a, out: out + noise)
        labels = alone.pop("labels")
        causal_lm_per_sample_loss(reference(**alone), labels).sum().backward()
        handle.remove()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(got[name][i], p.grad, rtol=1e-4, atol=1e-6, msg=name)


class NoiseProbe(TrainerCallback):
    """Once the trainer's NEFTune is on the model (it attaches at the first non-empty micro-batch), records how far
    each embedding output in training lies from the plain lookup of its ids: its hook runs after NEFTune's."""

    def __init__(self, embedding, neftune):
        self.embedding, self.neftune, self.gaps, self.handle = embedding, neftune, [], None

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is None and self.neftune.model is not None:
            self.handle = self.embedding.register_forward_hook(self.record)

    def record(self, module, inputs, output):
        if module.training:
            self.gaps.append((output - module.weight[inputs[0]]).detach())  # read after training: nothing leaves torch


#: A sampling seed whose first three Poisson draws (16 rows, rate 1/4) are all non-empty, so the probe sees two
#: noised training forwards (an unseeded run starts with an empty micro-batch in about 1% of runs).
SEED_WITHOUT_EMPTY_DRAWS = 0


def test_the_private_trainer_trains_with_its_own_neftune_and_takes_it_off_after(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt2(TOKENIZER)
    embedding = model.get_input_embeddings()
    args = cpu_training_args(str(tmp_path), max_steps=3, per_device_train_batch_size=4, neftune_noise_alpha=ALPHA)
    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, sampling_seed=SEED_WITHOUT_EMPTY_DRAWS)
    trainer = DPTrainer(model=model, args=args, train_dataset=lm_dataset(TOKENIZER, 16), data_collator=COLLATE,
                        privacy_args=privacy)
    neftune = trainer._dp_neftune
    probe = NoiseProbe(embedding, neftune)
    trainer.add_callback(probe)
    assert trainer.neftune_noise_alpha is None and neftune.alpha == ALPHA  # transformers' own hook never attached
    before = trainable_copy(model)
    trainer.train()
    assert trainer.privacy_budget.steps == 3 and trainer.grad_sample_mode == "bk"
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert len(probe.gaps) == 2 and all(gap.abs().max() > 0 for gap in probe.gaps)  # steps 2 and 3 were noised
    assert neftune.model is None and not any(getattr(h, "__self__", None) is neftune
                                             for h in embedding._forward_hooks.values())
    probe.handle.remove()


def test_a_forward_without_attention_mask_is_refused_naming_it():
    model = tiny_gpt2(TOKENIZER).train()
    neftune = PrivateNEFTune(ALPHA)
    neftune.follow(model)
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=torch.tensor([[5, 6, 7]]))
    neftune.remove()
    model(input_ids=torch.tensor([[5, 6, 7]]))  # off again
