"""Private QLoRA fine-tuning: LoRA adapters over a 4-bit quantized, frozen causal LM, with DPTrainer.

The QLoRA recipe as PEFT documents it: the base loaded with transformers' ``BitsAndBytesConfig``
(NF4 weights, double quantization), ``prepare_model_for_kbit_training``, LoRA on every linear layer.
Offline, the base is a tiny Llama built from a config and saved first; with a real checkpoint, pass
its name to ``from_pretrained`` instead. bitsandbytes' CPU backend runs it here (``pip install
dptorch[qlora]``); on a GPU the same script runs with ``use_cpu=False``.

Two settings matter for privacy, both below: activation checkpointing must be non-reentrant (PEFT
turns on the reentrant kind by default, which dptorch does not yet clip exactly), and an 8-bit base
(``load_in_8bit=True``) needs ``llm_int8_threshold=0.0`` (LLM.int8()'s outlier threshold picks
columns from the whole batch, so samples would meet; dptorch refuses it).

    python examples/qlora.py [max_steps]
"""

from __future__ import annotations

import math
import sys
import time

import bitsandbytes as bnb
import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from common import cpu_training_args, lm_dataset, one_thread, output_folder, tiny_llama, word_tokenizer
from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments

QUANTIZATION = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.float32)  # bfloat16 on a GPU


def main(max_steps: int = 40) -> dict:
    with output_folder("qlora") as output_dir:
        return run(output_dir, max_steps)


def run(output_dir: str, max_steps: int) -> dict:
    one_thread()
    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    tiny_llama(tokenizer).save_pretrained(output_dir + "/base")  # stands in for a downloaded checkpoint
    base = AutoModelForCausalLM.from_pretrained(output_dir + "/base", quantization_config=QUANTIZATION,
                                                device_map="cpu")
    base = prepare_model_for_kbit_training(base, gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            # CPU only: bitsandbytes repacks 4-bit weights for its inference kernel at the first eval-mode
            # forward (failing below 64 input features), and the repacked layer cannot train any more
            layer.support_avx512bf16_for_cpu = False
    trainer = DPTrainer(
        model=model,
        args=cpu_training_args(output_dir, max_steps=max_steps, per_device_train_batch_size=16,
                               gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=10,
                               per_device_eval_batch_size=64),
        train_dataset=lm_dataset(tokenizer, 1024),
        data_collator=DataCollatorForPrivateCausalLanguageModeling(tokenizer),
        privacy_args=PrivacyArguments(target_epsilon=8.0, target_delta=1e-4, per_sample_max_grad_norm=1.0),
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"trainable (LoRA) parameters: {trainable:,}; the base's linear layers are 4-bit NF4 and frozen")
    held_out = lm_dataset(tokenizer, 64, seed=1)
    before = trainer.evaluate(held_out)["eval_loss"]
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    after = trainer.evaluate(held_out)["eval_loss"]
    assert isinstance(trainer.model, PeftModel)
    trainer.model.save_pretrained(output_dir + "/adapter")  # the adapter alone; the base stays as downloaded
    print(f"held-out perplexity {math.exp(before):.1f} -> {math.exp(after):.1f}")
    print(f"{trainer.state.global_step} steps in {seconds:.1f}s ({trainer.state.global_step / seconds:.2f} steps/s)")
    print(f"epsilon = {trainer.get_epsilon():.3f} at delta = 1e-4 (noise multiplier {trainer.noise_multiplier:.3f})")
    return {"epsilon": trainer.get_epsilon(), "loss_before": before, "loss_after": after}


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
