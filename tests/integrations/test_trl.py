"""private(trl.SFTTrainer) and private(trl.DPOTrainer) with the real TRL, PEFT and Accelerate."""

import copy

import pytest
import torch

trl = pytest.importorskip("trl")

from peft import LoraConfig, PeftModel  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from dptorch.integrations.hf import PrivacyArguments, private  # noqa: E402
from dptorch.grad_sample.units.per_sample_losses import causal_lm_per_sample_loss  # noqa: E402
from dptorch.integrations.hf.sampling import UNIT_IDS_KEY  # noqa: E402
from tests.integrations.test_hf_trainer import TOKENIZER  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    common,
    preference_dataset,
    text_dataset,
    tiny_gpt2,
    tiny_llama,
    trainable_copy,
    without_dropout,
)

prompt_completion_dataset = common.prompt_completion_dataset
PRIVACY = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3)
COMMON = dict(use_cpu=True, bf16=False, report_to=[], disable_tqdm=True, logging_steps=1, save_strategy="no",
              max_length=32, per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2)


def sft(tmp_path, model, privacy=PRIVACY, peft_config=None, dataset=None, **config):
    torch.manual_seed(0)
    args = SFTConfig(output_dir=str(tmp_path), **{**COMMON, **config})
    return private(SFTTrainer)(model=model, args=args, train_dataset=dataset or text_dataset(32),
                               processing_class=TOKENIZER, peft_config=peft_config, privacy_args=privacy)


def dpo(tmp_path, model, dataset=None, privacy=PRIVACY, peft_config=None, ref_model=None, **config):
    torch.manual_seed(0)
    args = DPOConfig(output_dir=str(tmp_path), **{**COMMON, **config})
    return private(DPOTrainer)(model=model, ref_model=ref_model, args=args, train_dataset=dataset or preference_dataset(32),
                               processing_class=TOKENIZER, peft_config=peft_config, privacy_args=privacy)


def test_sft_with_lora_and_activation_checkpointing(tmp_path):
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = sft(tmp_path, tiny_llama(TOKENIZER), peft_config=config)  # TRL's default: gradient checkpointing on
    assert type(trainer).__name__ == "DPSFTTrainer" and isinstance(trainer.model, PeftModel)
    assert trainer.args.gradient_checkpointing
    lora = trainable_copy(trainer.model)
    trainer.train()
    assert all(not torch.equal(p, lora[n]) for n, p in trainer.model.named_parameters() if n in lora)
    assert trainer.privacy_budget.steps == 2 and trainer.state.log_history[-1]["epsilon"] > 0


def test_sft_full_fine_tuning_bypasses_the_fused_lm_head(tmp_path):
    """GPT-2 ties lm_head to wte; TRL's fused head would read it directly, without per-sample grads."""
    model = tiny_gpt2(TOKENIZER)
    trainer = sft(tmp_path, model, gradient_checkpointing=False)
    before = trainable_copy(model)
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def tiny_qwen2_moe(tokenizer):
    """A Qwen2-MoE decoder (three experts, top 2, a shared expert), no router auxiliary loss."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=3, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, router_aux_loss_coef=0.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


@pytest.mark.parametrize("packing, build, mode", [
    ("packing", tiny_llama, "hooks"), ("padding_free", tiny_llama, "hooks"), ("packing", tiny_qwen2_moe, "bk"),
])
def test_sft_packs_after_sampling_and_each_example_matches_itself_alone(tmp_path, packing, build, mode):
    """TRL's packing and padding-free rows, made of Poisson-drawn examples: each example (completion-only loss,
    gradient checkpointing on, as TRL's defaults) gets the gradient it has alone, unpacked; a mixture-of-experts
    model's too."""
    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, grad_sample_mode=mode, sampling_seed=3)
    torch.manual_seed(0)
    model = without_dropout(build(TOKENIZER))
    trainer = sft(tmp_path, model, privacy=privacy, dataset=prompt_completion_dataset(32), max_length=24,
                  per_device_train_batch_size=8, **{packing: True})
    assert getattr(trainer.args, packing) and trainer.args.gradient_checkpointing  # the user's config, unchanged
    assert len(trainer.train_dataset) == 32 and "seq_lengths" not in trainer.train_dataset.column_names  # unpacked
    batch = next(iter(trainer.get_train_dataloader()))
    units = batch[UNIT_IDS_KEY]
    assert units.dim() == 2 and (units.shape[0] == 1) == (packing == "padding_free")
    examples = [(batch["input_ids"][units == u], batch["labels"][units == u]) for u in range(int(units.max()) + 1)]
    assert len(examples) >= 3 and all((labels[:1] == -100).all() for _, labels in examples)  # prompts masked
    reference = build(TOKENIZER)  # the reference: plain autograd (no hooks), each example alone
    reference.load_state_dict(model.state_dict())
    trainer.training_step(model, batch)
    params = dict(reference.named_parameters())
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if mode == "hooks":
        per_unit = {n: trainer.dp_hooks.grad_samples[p].clone() for n, p in trained}
    else:  # bk forms norms, not per-example gradients: each example's norm over all parameters
        norms = trainer.dp_hooks.per_sample_norms()
        per_unit = {"norm": torch.stack([norms[p] for _, p in trained]).pow(2).sum(0).sqrt()}
    trainer.dp_hooks.clear()
    for u, (ids, labels) in enumerate(examples):
        reference.zero_grad()
        causal_lm_per_sample_loss(reference(input_ids=ids[None], use_cache=False), labels[None]).sum().backward()
        alone = {name: params[name].grad for name in per_unit if name != "norm"}
        if "norm" in per_unit:
            alone["norm"] = torch.stack([params[n].grad.norm() for n, _ in trained]).norm()
        for name, g in per_unit.items():
            torch.testing.assert_close(g[u], alone[name], rtol=1e-4, atol=1e-6)


def test_sft_packing_trains_with_the_unpacked_accounting(tmp_path):
    packed = sft(tmp_path, tiny_gpt2(TOKENIZER), packing=True, gradient_checkpointing=False)
    plain = sft(tmp_path, tiny_gpt2(TOKENIZER), gradient_checkpointing=False)
    assert packed.privacy_plan.sample_rate == plain.privacy_plan.sample_rate  # q over examples, not packed rows
    packed.train()
    assert packed.privacy_budget.steps == 2 and packed.get_epsilon() == pytest.approx(plain.privacy_budget.epsilon_after(2))


@pytest.mark.parametrize("setting, match", [
    (dict(packing=True, packing_strategy="wrapped"), "splits an example"),
    (dict(packing=True, model_kwargs=dict(attn_implementation="eager")), "attn_implementation='eager'"),
    (dict(padding_free=True, privacy=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3,
                                                      privacy_unit_column="user")), "privacy_unit_column"),
])
def test_sft_packing_refuses_what_it_cannot_keep_apart(tmp_path, setting, match):
    setting = dict(setting)
    model = tiny_llama(TOKENIZER)
    model.config._attn_implementation = setting.pop("model_kwargs", {}).get("attn_implementation", "sdpa")
    dataset = text_dataset(32).add_column("user", [i % 5 for i in range(32)])
    with pytest.raises(ValueError, match=match):
        sft(tmp_path, model, dataset=dataset, **setting)


def test_dpo_with_lora_trains_privately(tmp_path):
    config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    trainer = dpo(tmp_path, tiny_gpt2(TOKENIZER), peft_config=config)
    lora = trainable_copy(trainer.model)
    trainer.train()
    assert isinstance(trainer.model, PeftModel)
    assert all(not torch.equal(p, lora[n]) for n, p in trainer.model.named_parameters() if n in lora)
    assert trainer.privacy_budget.steps == 2 and trainer.get_epsilon() > 0


def test_dpo_units_are_pairs_and_users(tmp_path):
    """A unit's rows (its chosen and rejected rows, and all pairs of one user) are summed before clipping:
    each unit's per-sample gradient equals the sum of the gradients of its pairs, each computed alone.
    (Per-sample gradients against plain autograd are checked by the Trainer and LoRA tests.)"""
    users = ["ann", "bob", "ann", "cid"]
    data = preference_dataset(4).add_column("user", users)
    config = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False, task_type="CAUSAL_LM")
    # hooks mode: the test reads the per-sample gradients of every parameter (bk keeps only norms and sums)
    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, privacy_unit_column="user", grad_sample_mode="hooks")
    trainer = dpo(tmp_path, without_dropout(tiny_gpt2(TOKENIZER)), dataset=data, privacy=privacy, peft_config=config,
                  per_device_train_batch_size=3, gradient_checkpointing=False)
    assert trainer.sampling_plan.sample_rate == 1.0  # 3 units, 3 per batch: every unit every step
    model, hooks = trainer.model, trainer.dp_hooks
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 8  # 4 pairs -> 8 rows, chosen then rejected
    trainer.training_step(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    per_unit = {p: g.clone() for p, g in hooks.grad_samples.items()}
    assert all(per_unit[p].shape[0] == 3 for p in params)
    hooks.clear()
    for unit, name in enumerate(["ann", "bob", "cid"]):  # units are numbered in order of first appearance
        alone = {p: torch.zeros_like(p) for p in params}
        for i in [i for i, u in enumerate(users) if u == name]:
            trainer.training_step(model, trainer.data_collator([trainer.train_dataset[i]]))
            for p, g in hooks.grad_samples.items():
                assert g.shape[0] == 1  # one pair, two rows: one unit
                alone[p] += g[0]
            hooks.clear()
        for p in params:
            assert alone[p].abs().max() > 0
            assert torch.allclose(per_unit[p][unit], alone[p], atol=1e-6), (name, hooks.parameter_name(p))


def test_dpo_refuses_a_trainable_lm_head_and_cross_sample_losses(tmp_path):
    with pytest.raises(ValueError, match="fused LM head"):
        model = tiny_llama(TOKENIZER)  # full fine-tuning: lm_head is read directly by TRL's fused head
        dpo(tmp_path, model, ref_model=copy.deepcopy(model))
    config = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="'aot' sorts"):
        dpo(tmp_path, tiny_llama(TOKENIZER), peft_config=config, loss_type=["aot"])
