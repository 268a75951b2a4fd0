"""The one-run audit of a real run: the MiniLM demo (``make demo``'s job) at epsilon 8 with 1,000 canaries.

``python benchmarks/audit_minilm.py`` fine-tunes MiniLM on tweets exactly as
:func:`dptorch.cli.examples.minilm.run` does (2000 training tweets, batch 128, 3 epochs = 48 steps,
lr 2e-2, LoRA in the top layer, clipping 1.0, target epsilon 8 at delta 1e-5, seed 0), through
``DPTrainer``, once with ``PrivacyArguments(audit_canaries=1000)`` (Dirac gradient canaries) and once
without: the audited lower bounds of both methods at 95% confidence (at every step, from the
Trainer's logs), and the test accuracy with and without canaries (their utility cost). Writes
``benchmarks/results/audit_minilm.json`` and ``docs/images/audit-minilm.png`` (claimed epsilon
against both bounds over the run). One thread; a few minutes per run on a 2-core CPU.
``--seeds 0 1 2`` repeats it over seeds (data split, initialisation, sampling, noise, canaries).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import torch
from transformers import AutoTokenizer, DataCollatorWithPadding
from transformers.utils import logging as hf_logging

from dptorch.auditing import plot_audit_history
from dptorch.cli.examples.minilm import (
    TokenizedTexts,
    accuracy,
    load_tweets,
    minilm_classifier,
    minilm_path,
    trainer_settings,
)
from dptorch.integrations.hf import DPTrainer, PrivacyArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(seed: int, canaries: int, epsilon: float = 8.0, delta: float = 1e-5) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    train_examples, test_examples = load_tweets(2000, 500, seed)
    train_set, test_set = TokenizedTexts(tokenizer, train_examples, 40), TokenizedTexts(tokenizer, test_examples, 40)
    collate = DataCollatorWithPadding(tokenizer)
    model = minilm_classifier(1, seed)
    privacy = PrivacyArguments(target_epsilon=epsilon, target_delta=delta, per_sample_max_grad_norm=1.0,
                               sampling_seed=seed, noise_seed=seed, audit_canaries=canaries, audit_seed=seed)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dptorch-audit-") as workdir:
        trainer = DPTrainer(model=model, privacy_args=privacy,
                            **trainer_settings(workdir, train_set=train_set, collate=collate, epochs=3.0,
                                               batch_size=128, lr=2e-2, seed=seed))
        trainer.train()
    result = {"seed": seed, "canaries": canaries, "accuracy": accuracy(model, test_set, collate),
              "epsilon": trainer.get_epsilon(), "noise_multiplier": trainer.noise_multiplier,
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "seconds": time.perf_counter() - start}
    if canaries:
        result["audit"] = trainer.privacy_report()["audit"]
        result["history"] = [audit.to_dict() for audit in trainer.dp_audit.history]
        result["_history"] = trainer.dp_audit.history
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "audit_minilm.json"))
    parser.add_argument("--plot", default=os.path.join(ROOT, "docs", "images", "audit-minilm.png"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    runs = []
    for seed in args.seeds:
        for canaries in (args.canaries, 0):
            run = one_run(seed, canaries)
            history = run.pop("_history", None)
            if history is not None and seed == args.seeds[0]:
                plot_audit_history(history, args.plot, title=f"MiniLM demo, epsilon 8: one-run audit, "
                                                               f"{args.canaries} canaries (seed {seed})")
            runs.append(run)
            audit = run.get("audit")
            print(f"seed {seed}, {canaries} canaries: accuracy {run['accuracy']:.3f}, epsilon {run['epsilon']:.3f}"
                  + (f", audited >= {audit['steinke_epsilon']:.4f} (Steinke) / {audit['fdp_epsilon']:.4f} (f-DP) at "
                     f"{audit['confidence']:.0%}, {audit['num_included']} of {audit['num_canaries']} canaries in"
                     if audit else "") + f" ({run['seconds']:.0f} s)", flush=True)
    with open(args.out, "w") as handle:
        json.dump({"command": "python benchmarks/audit_minilm.py " + " ".join(
            f"--seeds {' '.join(map(str, args.seeds))}".split()), "runs": runs}, handle, indent=1)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
