"""Private preference optimisation with TRL: ``private(trl.DPOTrainer)``, user-level DP, LoRA.

Each user contributed several (prompt, chosen, rejected) examples. With
``privacy_unit_column="user"`` a user is one privacy unit: Poisson sampling draws users, all of a
user's examples go into the same micro-batch, and the gradients of their rows (each example is a
chosen and a rejected row of the concatenated batch) are summed before clipping, so the guarantee
covers everything one user contributed. The reference model is the base model with the LoRA
adapters switched off; its forward runs without gradients and costs no per-sample work.

    python examples/dpo.py
"""

from __future__ import annotations

import sys
import time

import torch
from peft import LoraConfig
from trl import DPOConfig, DPOTrainer

from common import one_thread, output_folder, preference_dataset, tiny_gpt2, word_tokenizer
from dptorch.integrations.hf import PrivacyArguments, private


def main(max_steps: int = 20) -> dict:
    with output_folder("dpo") as output_dir:
        return run(output_dir, max_steps)


def run(output_dir: str, max_steps: int) -> dict:
    one_thread()
    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    data = preference_dataset(960)
    data = data.add_column("user", [f"user{i % 320}" for i in range(len(data))])  # 320 users, 3 examples each
    config = DPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to=[], disable_tqdm=True,
        save_strategy="no", max_steps=max_steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=5e-3, logging_steps=5, max_length=32, beta=0.1,
        activation_checkpointing=False,  # TRL's default is on; a model this small gains nothing from it
    )
    trainer = private(DPOTrainer)(
        model=tiny_gpt2(tokenizer),
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, task_type="CAUSAL_LM"),
        privacy_args=PrivacyArguments(target_epsilon=4.0, target_delta=1e-4, privacy_unit_column="user"),
    )
    report = trainer.privacy_report()
    print(f"{report['num_units']} privacy units ({report['privacy_unit']}), sample rate {report['sample_rate']:.4f}")
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    margins = [h["rewards/margins"] for h in trainer.state.log_history if "rewards/margins" in h]
    print(f"reward margin (not private, for inspection only): {margins[0]:.4f} -> {margins[-1]:.4f}")
    print(f"{trainer.state.global_step} steps in {seconds:.1f}s ({trainer.state.global_step / seconds:.2f} steps/s)")
    print(f"epsilon = {trainer.get_epsilon():.3f} at delta = 1e-4 (noise multiplier {trainer.noise_multiplier:.3f})")
    return {"epsilon": trainer.get_epsilon(), "margins": margins}


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
