"""QLoRA: LoRA adapters over a bitsandbytes-quantized frozen base (4-bit NF4, 8-bit LLM.int8()) train
privately and exactly, through the controller, make_private and the DPTrainer; LLM.int8()'s outlier
threshold, which reads the whole batch, is refused.

The base is a tiny Llama saved from a config and loaded with transformers' ``BitsAndBytesConfig`` (on
the CPU: bitsandbytes' CPU backend). References are the same quantized model at batch size one."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from dptorch import PrivacyEngine  # noqa: E402
from dptorch.grad_sample.errors import PerSampleGradientError  # noqa: E402
from dptorch.integrations.hf import PrivacyArguments  # noqa: E402
from tests.grad_sample.oracle import assert_exact  # noqa: E402
from tests.helpers import projection_loss  # noqa: E402
from tests.integrations.test_hf_trainer import TOKENIZER, make_trainer, unit_reference_update  # noqa: E402
from tests.integrations.tiny import lm_dataset, tiny_llama, trainable_copy, without_dropout  # noqa: E402

QUANTIZATIONS = {
    "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32),
    "fp4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
    "int8": BitsAndBytesConfig(load_in_8bit=True),  # training on the CPU: the weight dequantized, then linear
    "int8-rows": BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0),
}


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    tiny_llama(TOKENIZER).save_pretrained(str(path))
    return str(path)


def qlora(path, quantization, base_eval=False, prepare=False):
    """LoRA adapters (randomly initialised, so that A and B both get gradients) over the quantized base;
    ``base_eval``: the quantized layers in eval mode (LLM.int8()'s matmul of inference and of GPUs);
    ``prepare``: PEFT's QLoRA recipe first (activation checkpointing, non-reentrant, or reentrant with
    ``prepare="reentrant"``; inputs that require grad)."""
    config = QUANTIZATIONS[quantization] if isinstance(quantization, str) else quantization
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu", dtype=torch.float32)
    if prepare:
        kwargs = {"use_reentrant": prepare == "reentrant"}
        base = prepare_model_for_kbit_training(base, gradient_checkpointing_kwargs=kwargs)
        assert base.is_gradient_checkpointing
    torch.manual_seed(1)
    model = get_peft_model(without_dropout(base), LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"],
                                                             init_lora_weights=False, task_type="CAUSAL_LM"))
    quantized = [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    assert len(quantized) == 14  # 7 linear layers per decoder layer; the LM head stays unquantized
    model.train()
    for m in quantized:
        m.train(not base_eval)
    return model


def logits_projection(out):
    return projection_loss(out.logits)


def ids(n=4, length=6, seed=0):
    return torch.randint(3, len(TOKENIZER), (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("quantization, base_eval", [("nf4", False), ("fp4", False), ("int8", False),
                                                     ("int8-rows", True)])
def test_adapters_per_sample_gradients_are_exact(saved_llama, quantization, base_eval, mode):
    """Per-sample gradients (hooks) or norms and clipped sums (bk) of the adapters equal each sample's alone."""
    model = qlora(saved_llama, quantization, base_eval)
    assert_exact(model, {"input_ids": ids()}, {"input_ids": 0}, logits_projection, mode, 4)


def test_the_outlier_threshold_couples_samples_and_zero_does_not():
    """Why the threshold is refused: with it, one sample's outlier changes another sample's output."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(16, 8)
    outputs = {}
    for threshold in (6.0, 0.0):
        layer = bnb.nn.Linear8bitLt(16, 8, has_fp16_weights=False, threshold=threshold)
        layer.load_state_dict(dense.state_dict())
        layer.eval()  # the matmul bitsandbytes runs on GPUs, and on the CPU outside training
        x = torch.randn(2, 16)
        alone = layer(x[:1])
        x[1, 3] = 50.0  # an outlier in the other sample only
        outputs[threshold] = (layer(x)[:1] - alone).abs().max().item()
    assert outputs[6.0] > 1e-3 and outputs[0.0] == 0.0


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_the_outlier_threshold_is_refused_before_any_step(saved_llama, mode):
    model = qlora(saved_llama, "int8", base_eval=True)  # threshold 6.0 (transformers' default)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loader = DataLoader(TensorDataset(ids(16)), batch_size=8)
    _, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        grad_sample_mode=mode, wrap_model=False, poisson_sampling=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (x,) = next(iter(loader))
    with pytest.raises(PerSampleGradientError, match=r"llm_int8_threshold=0\.0"):
        token_losses(model, x).mean().backward()
        optimizer.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def token_losses(model, x):
    """Each sample's summed next-token loss."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none").sum(1)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_make_private_trains_the_adapters_with_exact_norms(saved_llama, mode):
    """make_private(wrap_model=False) over a 4-bit base: each drawn sample's norm is its own gradient's,
    the adapters move, the quantized base does not."""
    model = qlora(saved_llama, "nf4")
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    hooks, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(ids(16)), batch_size=8),
        noise_multiplier=1.0, max_grad_norm=0.5, grad_sample_mode=mode, wrap_model=False)
    norms = []
    hooks.add_backward_listener(lambda h: norms.append(h.per_sample_norms()))
    adapters, frozen = trainable_copy(model), {n: p.detach().clone() for n, p in model.named_parameters()
                                               if not p.requires_grad}
    for (x,) in loader:
        if len(x):
            break
    token_losses(model, x).mean().backward()
    optimizer.step()
    grads = _alone(reference, x)
    got = torch.stack([g for g in norms[0].values()]).pow(2).sum(0).sqrt()
    torch.testing.assert_close(got, grads, rtol=1e-4, atol=1e-6)
    assert all(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if n in adapters)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def _alone(model, x):
    """Each sample's gradient norm over the adapters, the sample alone in the batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(len(x)):
        model.zero_grad(set_to_none=True)
        token_losses(model, x[i : i + 1]).sum().backward()
        out.append(torch.stack([p.grad.norm() for p in params]).norm())
    return torch.stack(out)


@pytest.mark.parametrize("prepare", [False, "non-reentrant"])
def test_dptrainer_update_is_the_clipped_per_sample_sum(saved_llama, tmp_path, prepare):
    """Noise 0, q = 1, GA = 2, a 4-bit base (as loaded, or after prepare_model_for_kbit_training): the
    DPTrainer's update is the batch-of-one reference's."""
    model = qlora(saved_llama, "nf4", prepare=prepare)
    data = lm_dataset(TOKENIZER, 6)
    trainer = make_trainer(
        tmp_path, model=copy.deepcopy(model), dataset=data, max_steps=1, per_device_train_batch_size=3,
        privacy=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=0.05, target_delta=1e-3))
    start = trainable_copy(trainer.model)
    trainer.train()
    expected = unit_reference_update(model, data, None, clip=0.05, lr=0.05)
    trained = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert len(trained) == len(expected) == 12
    for (name, p), delta in zip(trained, expected):
        assert delta.abs().max() > 0, name
        assert torch.allclose(p - start[name], delta, atol=1e-6), name


def test_one_sample_moves_the_adapters_by_at_most_the_clip_bound_under_reentrant_checkpointing(saved_llama, tmp_path):
    """PEFT's prepare_model_for_kbit_training turns on reentrant checkpointing unless told otherwise: with one
    sample, q = 1 and no noise, the update is -lr * clip(g), of norm at most lr * C."""
    model = qlora(saved_llama, "nf4", prepare="reentrant")
    trainer = make_trainer(
        tmp_path, model=model, dataset=lm_dataset(TOKENIZER, 1), max_steps=1, per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        privacy=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=0.05, target_delta=1e-3))
    start = trainable_copy(model)
    trainer.train()
    update = torch.stack([(p - start[n]).norm() for n, p in model.named_parameters() if n in start]).norm()
    assert update <= 0.05 * 0.05 * (1 + 1e-5)


def test_the_example_runs_and_reports_epsilon(capsys):
    from tests.integrations.test_examples import load

    result = load("qlora").main(2)
    assert 0 < result["epsilon"] < math.inf
    assert "epsilon =" in capsys.readouterr().out
