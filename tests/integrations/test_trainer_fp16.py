"""DPTrainer with ``fp16=True``.

Measured with Accelerate 1.15 on CPU: ``fp16=True, use_cpu=True`` gives ``mixed_precision="fp16"``
but no autocast (``native_amp`` False) and no GradScaler: the Trainer trains in float32, so the
run must equal the float32 one exactly. On a GPU Accelerate builds a ``torch.amp.GradScaler`` and
autocasts the forward to float16; the second test sets up exactly that on CPU (``native_amp`` on,
a ``torch.amp.GradScaler("cpu")``, torch's float16 CPU autocast) and checks that DPTrainer swaps
in a ``DPGradScaler`` of the same initial scale, that the forward ran in float16, and that the
step is the float32 one within ``4 u`` (``u = 2^-11``, float16's unit roundoff; the argument of
tests/optim/test_fp16_loss_scaling.py; measured here: 0.68 u, and 0.71 u in the overflow test).
A unit whose gradient overflows float16 under the scale contributes zero, and the step is still
taken and accounted.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments  # noqa: E402
from dptorch.grad_sample.units.per_sample_losses import causal_lm_per_sample_loss  # noqa: E402
from dptorch.optim import DPGradScaler, NonFiniteGradientWarning  # noqa: E402
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_gpt2, trainable_copy, word_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")
TOKENIZER = word_tokenizer()
BOUND = 4 * 2.0**-11


def marked_rows(count: int, marked: int):
    """``count`` sentences; row ``marked`` starts with BOS, which no other row holds first."""
    rows = lm_dataset(TOKENIZER, count)
    ids = [list(r) for r in rows["input_ids"]]
    assert all(r[0] != TOKENIZER.bos_token_id for r in ids)
    ids[marked][0] = TOKENIZER.bos_token_id
    return rows.from_dict({"input_ids": ids})


def weighted_loss(weight: float):
    """The causal LM loss of each row, times ``weight`` for the BOS-marked row (whose gradient it scales)."""
    def per_sample_loss(outputs, labels):
        marked = labels[:, 0] == TOKENIZER.bos_token_id
        return causal_lm_per_sample_loss(outputs, labels) * torch.where(marked, weight, 1.0)

    return per_sample_loss


def train(tmp_path, *, fp16: bool, gpu_like_scale=None, dataset=None, per_sample_loss_func=None, **privacy):
    """One private step (two micro-batches of 4, noiseless, lr 1; q = 1/4, or 1 on a dataset of 8); returns the
    trainer, the update applied, the dtypes of an MLP output seen in the forwards and the non-finite warnings."""
    torch.manual_seed(0)
    model = tiny_gpt2(TOKENIZER)
    before = trainable_copy(model)
    args = cpu_training_args(str(tmp_path), max_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             optim="sgd", lr_scheduler_type="constant", learning_rate=1.0, max_grad_norm=0.0, fp16=fp16)
    trainer = DPTrainer(model=model, args=args, train_dataset=lm_dataset(TOKENIZER, 32) if dataset is None else dataset,
                        data_collator=DataCollatorForPrivateCausalLanguageModeling(TOKENIZER),
                        privacy_args=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=1.0, sampling_seed=0,
                                                      **privacy),
                        per_sample_loss_func=per_sample_loss_func)
    if gpu_like_scale is not None:  # what Accelerate sets up for fp16=True on a CUDA device
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=gpu_like_scale)
    dtypes = set()
    handle = model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, a, out: dtypes.add(out.dtype))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    handle.remove()
    after = trainable_copy(model)
    update = torch.cat([(before[k] - after[k]).reshape(-1) for k in before])
    nonfinite = [w for w in caught if issubclass(w.category, NonFiniteGradientWarning)]
    return trainer, update, dtypes, nonfinite


def test_fp16_on_cpu_is_what_accelerate_makes_of_it_float32(tmp_path):
    trainer, update, dtypes, _ = train(tmp_path / "fp16", fp16=True)
    assert trainer.accelerator.state.mixed_precision == "fp16"
    assert trainer.accelerator.scaler is None and not trainer.accelerator.native_amp and dtypes == {torch.float32}
    _, reference, _, _ = train(tmp_path / "fp32", fp16=False)
    assert torch.equal(update, reference)


def test_fp16_with_accelerates_gpu_scaler_trains_with_a_dp_grad_scaler(tmp_path):
    trainer, update, dtypes, nonfinite = train(tmp_path / "fp16", fp16=True, gpu_like_scale=2.0**8)
    scaler = trainer.accelerator.scaler
    assert isinstance(scaler, DPGradScaler) and trainer.optimizer.scaler is scaler
    assert scaler.schedule["growth_interval"] is None and scaler.get_scale() == 2.0**8
    assert dtypes == {torch.float16} and not nonfinite
    assert trainer.privacy_plan.steps == trainer.state.global_step == 1
    _, reference, _, _ = train(tmp_path / "fp32", fp16=False)
    assert float((update - reference).norm() / reference.norm()) <= BOUND


def test_an_overflowed_unit_contributes_zero_and_the_step_is_taken(tmp_path):
    """Every unit is drawn (q = 1); the marked unit's loss, times 10^6, overflows float16 under the scale 2^8."""
    dataset = marked_rows(8, marked=3)
    trainer, update, _, nonfinite = train(tmp_path / "a", fp16=True, gpu_like_scale=2.0**8, dataset=dataset,
                                          per_sample_loss_func=weighted_loss(1e6))
    assert len(nonfinite) == 1 and "DPGradScaler init_scale" in str(nonfinite[0].message)
    assert trainer.privacy_plan.steps == trainer.state.global_step == 1 and not trainer.optimizer.step_was_skipped
    assert trainer.accelerator.scaler.get_scale() == 2.0**8  # no backoff
    _, without16, _, none = train(tmp_path / "b", fp16=True, gpu_like_scale=2.0**8, dataset=dataset,
                                  per_sample_loss_func=weighted_loss(0.0))  # the unit adds nothing
    assert not none and float((update - without16).abs().max()) <= 2.0**-22 * float(without16.abs().max())
    _, without32, _, _ = train(tmp_path / "c", fp16=False, dataset=dataset, per_sample_loss_func=weighted_loss(0.0))
    assert float((update - without32).norm() / without32.norm()) <= BOUND


def test_the_trainers_loss_scale_and_its_growth_come_from_the_privacy_arguments(tmp_path):
    trainer, _, dtypes, _ = train(tmp_path, fp16=True, gpu_like_scale=2.0**8, fp16_loss_scale=2.0**10,
                                  fp16_scale_growth_interval=5)
    scaler = trainer.accelerator.scaler
    assert isinstance(scaler, DPGradScaler) and dtypes == {torch.float16}
    assert scaler.schedule["init_scale"] == 2.0**10 and scaler.schedule["growth_interval"] == 5
    assert scaler.get_scale() == 2.0**10  # one step taken, the first growth after five


@pytest.mark.parametrize("fields, problem", [({"fp16_loss_scale": 1000.0}, "init_scale must be a power of two"),
                                             ({"fp16_scale_growth_interval": 0}, "growth_interval must be a whole")])
def test_a_loss_scale_that_cannot_be_exact_is_refused_in_the_arguments(fields, problem):
    with pytest.raises(ValueError, match=problem):
        PrivacyArguments(noise_multiplier=1.0, **fields)
