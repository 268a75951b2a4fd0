"""Private supervised fine-tuning with TRL: ``private(trl.SFTTrainer)``, offline on CPU.

A tiny Llama-style model (built from a config) learns to answer templated questions. TRL's
prompt-completion format trains on the completion tokens only; each example's loss is the mean
over its own completion tokens (not over the batch's, as TRL's default would), so one example's
gradient never depends on the others. TRL's defaults stay on where DP allows them (activation
checkpointing); its fused LM head is bypassed because it would read the LM head weights directly.

    python examples/sft.py
"""

from __future__ import annotations

import sys
import time

import torch
from trl import SFTConfig, SFTTrainer

from common import one_thread, output_folder, prompt_completion_dataset, tiny_llama, word_tokenizer
from dptorch.integrations.hf import PrivacyArguments, private


def main(max_steps: int = 40) -> dict:
    with output_folder("sft") as output_dir:
        return run(output_dir, max_steps)


def run(output_dir: str, max_steps: int) -> dict:
    one_thread()
    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    config = SFTConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to=[], disable_tqdm=True,
        save_strategy="no", max_steps=max_steps, per_device_train_batch_size=16, gradient_accumulation_steps=2,
        learning_rate=3e-3, logging_steps=10, max_length=32, per_device_eval_batch_size=64,
        activation_checkpointing=False,  # TRL's default is on; a model this small gains nothing from it
    )
    trainer = private(SFTTrainer)(
        model=tiny_llama(tokenizer),
        args=config,
        train_dataset=prompt_completion_dataset(1024),
        eval_dataset=prompt_completion_dataset(64, seed=1),
        processing_class=tokenizer,
        privacy_args=PrivacyArguments(target_epsilon=8.0, target_delta=1e-4),
    )
    before = trainer.evaluate()["eval_loss"]
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    after = trainer.evaluate()["eval_loss"]
    print(f"held-out completion loss {before:.3f} -> {after:.3f}")
    print(f"{trainer.state.global_step} steps in {seconds:.1f}s ({trainer.state.global_step / seconds:.2f} steps/s)")
    print(f"epsilon = {trainer.get_epsilon():.3f} at delta = 1e-4 (noise multiplier {trainer.noise_multiplier:.3f})")
    return {"epsilon": trainer.get_epsilon(), "loss_before": before, "loss_after": after}


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
