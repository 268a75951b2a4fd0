"""Private causal language modelling with the HuggingFace Trainer (DPTrainer), offline on CPU.

A tiny GPT-2 built from a config learns a templated corpus under (epsilon, delta)-DP, with the
noise calibrated to a target epsilon. Arguments are parsed by HfArgumentParser next to the
TrainingArguments, so any of them can be changed on the command line, e.g.

    python examples/trainer_causal_lm.py --target_epsilon 3 --max_steps 100
"""

from __future__ import annotations

import math
import sys
import time

import torch
from transformers import HfArgumentParser, TrainingArguments

from common import lm_dataset, one_thread, output_folder, tiny_gpt2, word_tokenizer
from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments

DEFAULTS = [
    "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no",
    "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "64", "--gradient_accumulation_steps", "2",
    "--max_steps", "40",
    "--learning_rate", "3e-3", "--logging_steps", "10", "--seed", "0",
    "--target_epsilon", "8", "--target_delta", "1e-4", "--per_sample_max_grad_norm", "1.0",
]


def mean_loss(trainer, dataset) -> float:
    return trainer.evaluate(dataset)["eval_loss"]


def main(argv=None) -> dict:
    with output_folder("trainer") as output_dir:
        return run(output_dir, argv)


def run(output_dir: str, argv=None) -> dict:
    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    training_args, privacy_args = parser.parse_args_into_dataclasses(["--output_dir", output_dir] + DEFAULTS + list(argv or []))
    one_thread()
    torch.manual_seed(training_args.seed)
    tokenizer = word_tokenizer()
    model = tiny_gpt2(tokenizer)
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=lm_dataset(tokenizer, 1024),
        data_collator=DataCollatorForPrivateCausalLanguageModeling(tokenizer),
        privacy_args=privacy_args,
    )
    held_out = lm_dataset(tokenizer, 64, seed=1)
    before = mean_loss(trainer, held_out)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    after = mean_loss(trainer, held_out)
    report = trainer.privacy_report()
    print(f"noise multiplier {report['noise_multiplier']:.3f} (calibrated), sample rate {report['sample_rate']:.4f}")
    print(f"held-out perplexity {math.exp(before):.1f} -> {math.exp(after):.1f}")
    print(f"{trainer.state.global_step} steps in {seconds:.1f}s ({trainer.state.global_step / seconds:.2f} steps/s)")
    print(f"epsilon = {trainer.get_epsilon():.3f} at delta = {report['delta']:g}")
    return {"epsilon": trainer.get_epsilon(), "loss_before": before, "loss_after": after}


if __name__ == "__main__":
    main(sys.argv[1:])
