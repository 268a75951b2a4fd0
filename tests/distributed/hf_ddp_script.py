"""DPTrainer on a tiny LoRA Llama under ``torchrun --nproc-per-node 2`` (launched by test_hf_ddp.py).

Run A trains 4 steps and saves a checkpoint at step 2; run B resumes from it. Each rank writes a
JSON file to ``OUT`` with what the test checks: the rows each micro-batch of run A held, the
sampling seed, the final LoRA parameters and epsilon of both runs, and the epsilon logs.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/hf_ddp_script.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from peft import LoraConfig, get_peft_model  # noqa: E402

from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments  # noqa: E402
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_llama, without_dropout, word_tokenizer  # noqa: E402

ROWS = 32
STEPS = 4


class RecordingCollator(DataCollatorForPrivateCausalLanguageModeling):
    """Records the token rows of every micro-batch it collates."""

    seen: list

    def __call__(self, features, *args, **kwargs):
        self.seen.append([list(f["input_ids"]) for f in features])
        return super().__call__(features, *args, **kwargs)


def build(output_dir: Path, tokenizer, collator):
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(without_dropout(tiny_llama(tokenizer)), config)
    args = cpu_training_args(
        str(output_dir), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2, optim="sgd",
        lr_scheduler_type="constant", learning_rate=0.5, max_grad_norm=0.0, save_strategy="steps", save_steps=2,
        include_num_input_tokens_seen="all",  # gathers over the ranks for every micro-batch, empty ones too
    )
    privacy = PrivacyArguments(noise_multiplier=0.8, target_delta=1e-3, per_sample_max_grad_norm=1.0)
    return DPTrainer(model=model, args=args, train_dataset=lm_dataset(tokenizer, ROWS), data_collator=collator,
                     privacy_args=privacy)


def lora_params(trainer):
    return {n: p.detach().flatten().tolist() for n, p in trainer.model.named_parameters() if p.requires_grad}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    tokenizer = word_tokenizer()
    collator = RecordingCollator(tokenizer)
    collator.seen = []
    full = build(out / "full", tokenizer, collator)
    full.train()
    seen = collator.seen
    collator.seen = []
    resumed = build(out / "resumed", tokenizer, collator)
    resumed.train(resume_from_checkpoint=str(out / "full" / "checkpoint-2"))
    report = {
        "rank": rank,
        "world_size": full.args.world_size,
        "seed": full._dp_sampling_seed,
        "sample_rate": full.privacy_plan.sample_rate,
        "steps_per_epoch": full.privacy_plan.steps_per_epoch,
        "micro_batches": full.sampling_plan.micro_batches,
        "seen": seen,
        "rows": [list(r) for r in lm_dataset(tokenizer, ROWS)["input_ids"]],
        "full": {"epsilon": full.get_epsilon(), "steps": full.privacy_plan.steps, "params": lora_params(full),
                 "logged": [h["epsilon"] for h in full.state.log_history if "epsilon" in h],
                 "tokens": full.state.num_input_tokens_seen},
        "resumed": {"epsilon": resumed.get_epsilon(), "steps": resumed.privacy_plan.steps,
                    "params": lora_params(resumed),
                    "logged": [h["epsilon"] for h in resumed.state.log_history if "epsilon" in h]},
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
