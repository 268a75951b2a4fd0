"""DPTrainer with PEFT LoRA adapters: the adapters train, the frozen base is untouched and costs no
per-sample work, and the model stays a PeftModel that saves clean adapter files."""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from dptorch.integrations.hf import PrivacyArguments  # noqa: E402
from tests.integrations.test_hf_trainer import TOKENIZER, make_trainer, unit_reference_update  # noqa: E402
from tests.integrations.tiny import lm_dataset, tiny_gpt2, tiny_llama, trainable_copy, without_dropout  # noqa: E402


def test_lora_adapters_train_privately_and_the_base_stays_frozen(tmp_path):
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    model = get_peft_model(tiny_gpt2(TOKENIZER), config)
    trainer = make_trainer(tmp_path, model=model)
    lora = trainable_copy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    captured = set()
    trainer.dp_hooks.add_backward_listener(lambda hooks: captured.update(hooks.per_sample_norms()))
    trainer.train()
    assert trainer.model is model and isinstance(trainer.model, PeftModel)
    assert lora and all("lora_" in n for n in lora)
    assert all(not torch.equal(p, lora[n]) for n, p in model.named_parameters() if n in lora)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert captured == {p for p in model.parameters() if p.requires_grad}  # no per-sample work for the base
    model.save_pretrained(str(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(tiny_gpt2(TOKENIZER), str(tmp_path / "adapter"))
    for name, p in model.named_parameters():
        if name in lora:
            assert torch.equal(reloaded.get_parameter(name), p), name


def test_lora_update_is_the_clipped_per_sample_sum(tmp_path):
    """Noise 0, q=1, GA=2 on Llama with randomly initialised adapters (so both A and B get gradients)."""
    torch.manual_seed(0)
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(without_dropout(tiny_llama(TOKENIZER)), config)
    data = lm_dataset(TOKENIZER, 6)
    trainer = make_trainer(
        tmp_path, model=copy.deepcopy(model), dataset=data, max_steps=1, per_device_train_batch_size=3,
        privacy=PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=0.05, target_delta=1e-3),
    )
    start = trainable_copy(trainer.model)
    trainer.train()
    expected = unit_reference_update(model, data, None, clip=0.05, lr=0.05)
    trained = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert len(trained) == len(expected) == 12
    for (name, p), delta in zip(trained, expected):
        assert delta.abs().max() > 0, name
        assert torch.allclose(p - start[name], delta, atol=1e-6), name
