"""Private sequence-to-sequence training with the HuggingFace Seq2SeqTrainer (T5), offline on CPU.

A tiny T5 built from a config learns to answer where a templated sentence happens ("the cat finds a small bird
by the lake ." -> "by the lake") under (epsilon, delta)-DP: ``private(Seq2SeqTrainer)`` trains on each
sentence's own token mean over its answer, and evaluates by generating answers (``predict_with_generate``).
Arguments are parsed by HfArgumentParser next to the Seq2SeqTrainingArguments, e.g.

    python examples/seq2seq.py --target_epsilon 3 --max_steps 200
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from transformers import DataCollatorForSeq2Seq, HfArgumentParser, Seq2SeqTrainer, Seq2SeqTrainingArguments

from common import one_thread, output_folder, place_dataset, tiny_t5, word_tokenizer
from dptorch.integrations.hf import PrivacyArguments, private

DEFAULTS = [
    "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no",
    "--per_device_train_batch_size", "32", "--per_device_eval_batch_size", "64", "--gradient_accumulation_steps", "2",
    "--max_steps", "60", "--learning_rate", "1e-2", "--logging_steps", "20", "--seed", "0",
    "--predict_with_generate", "true", "--generation_max_length", "6",
    "--target_epsilon", "8", "--target_delta", "1e-4", "--per_sample_max_grad_norm", "1.0",
]


def exact_match(tokenizer):
    """compute_metrics: the share of generated answers equal to the reference (padding and -100 dropped)."""
    ignored = {-100, tokenizer.pad_token_id}

    def metric(prediction) -> dict:
        pairs = zip(prediction.predictions, prediction.label_ids)
        return {"exact_match": float(np.mean([[i for i in p if i not in ignored] == [i for i in t if i not in ignored]
                                              for p, t in pairs]))}

    return metric


def main(argv=None) -> dict:
    with output_folder("seq2seq") as output_dir:
        return run(output_dir, argv)


def run(output_dir: str, argv=None) -> dict:
    parser = HfArgumentParser((Seq2SeqTrainingArguments, PrivacyArguments))
    training_args, privacy_args = parser.parse_args_into_dataclasses(["--output_dir", output_dir] + DEFAULTS + list(argv or []))
    one_thread()
    torch.manual_seed(training_args.seed)
    tokenizer = word_tokenizer()
    trainer = private(Seq2SeqTrainer)(
        model=tiny_t5(tokenizer),
        args=training_args,
        train_dataset=place_dataset(tokenizer, 1024),
        data_collator=DataCollatorForSeq2Seq(tokenizer),  # labels padded with -100; decoder inputs from each row's own
        compute_metrics=exact_match(tokenizer),
        privacy_args=privacy_args,
    )
    held_out = place_dataset(tokenizer, 128, seed=1)
    before = trainer.evaluate(held_out)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    after = trainer.evaluate(held_out)
    report = trainer.privacy_report()
    print(f"noise multiplier {report['noise_multiplier']:.3f} (calibrated), sample rate {report['sample_rate']:.4f}")
    print(f"held-out loss {before['eval_loss']:.2f} -> {after['eval_loss']:.2f}, generated answers exactly right "
          f"{before['eval_exact_match']:.0%} -> {after['eval_exact_match']:.0%}")
    print(f"{trainer.state.global_step} steps in {seconds:.1f}s ({trainer.state.global_step / seconds:.2f} steps/s)")
    print(f"epsilon = {trainer.get_epsilon():.3f} at delta = {report['delta']:g}")
    return {"epsilon": trainer.get_epsilon(), "exact_match": after["eval_exact_match"], "loss_after": after["eval_loss"]}


if __name__ == "__main__":
    main(sys.argv[1:])
