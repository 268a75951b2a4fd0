"""The private Trainer's captured step against the Trainer's plain steps, eager and compiled.

    python benchmarks/captured_trainer.py [--shape dispatch-gpt2] [--batch 4] [--seq 32] [--steps 20]

GPT-2 with its head tied (benchmarks/models.py's ``build``), rows of ``--seq`` random token ids, every
row one length (the collator's ``pad_to_multiple_of``), SGD, one thread. Each mode trains with
``Trainer.train()`` and times each optimizer step from the Trainer's ``on_step_begin`` to its
``on_step_end`` (the micro-batch from the loader, forward, backward, the optimizer's step):

* ``eager_plain`` / ``compiled_plain``: ``Trainer`` with ``per_device_train_batch_size=2 * --batch``
  (the private runs' padded rows: the same physical shape), ``torch_compile`` off / on.
* ``eager_dp``: ``DPTrainer`` with ``per_device_train_batch_size=--batch`` (Poisson micro-batches of
  ``--batch`` rows expected), ``capture_step=False``.
* ``captured_dp``: the same with ``torch_compile=True`` (the captured step, its default there) and
  ``capture_pad_to_multiple_of=2 * --batch``: one shape unless a draw exceeds it.
* ``captured_dp_pieces``: the same with ``capture_rows_per_replay=--rows-per-replay`` (default ``--batch``)
  instead: every micro-batch as replays of that many rows, one shape whatever the draw.

Medians of ``--steps`` steps after three warm-up steps; the first step of each compiled mode
(``*_first_step_s``: the trace and compilation) apart; ``*_traces``: the shapes traced.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from benchmarks.captured_step import SHAPES
    from benchmarks.models import build
except ImportError:  # run as a script: benchmarks/ is on the path
    from captured_step import SHAPES
    from models import build

MODES = ("eager_plain", "compiled_plain", "eager_dp", "captured_dp", "captured_dp_pieces")


def main() -> None:
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback

    from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments
    from examples.common import cpu_training_args, word_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dispatch-gpt2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows-per-replay", type=int, default=None, help="captured_dp_pieces' width (default --batch)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    family, layers, width, vocab, kv_heads = SHAPES[args.shape]
    rows = 64 * args.batch
    ids = torch.randint(0, vocab, (rows, args.seq), generator=torch.Generator().manual_seed(0))
    dataset = Dataset.from_dict({"input_ids": ids.tolist()})
    collator = DataCollatorForPrivateCausalLanguageModeling(word_tokenizer(), pad_to_multiple_of=args.seq)

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.seconds = []

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.start)

    result = {"shape": args.shape, "batch": args.batch, "seq": args.seq, "threads": 1}
    for mode in args.modes:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build(family, layers, width, vocab, True, kv_heads)
        private = "_dp" in mode
        training = cpu_training_args(
            tempfile.mkdtemp(), max_steps=args.steps + 4, optim="sgd", learning_rate=1e-3, logging_steps=10**6,
            max_grad_norm=0.0, per_device_train_batch_size=args.batch if private else 2 * args.batch,
            torch_compile=mode.startswith(("compiled", "captured")))
        kwargs = dict(model=model, args=training, train_dataset=dataset, data_collator=collator)
        if private:
            privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-5, capture_step=mode != "eager_dp",
                                       capture_pad_to_multiple_of=2 * args.batch if mode == "captured_dp" else None,
                                       capture_rows_per_replay=(args.rows_per_replay or args.batch)
                                       if mode == "captured_dp_pieces" else None)
            trainer = DPTrainer(**kwargs, privacy_args=privacy)
        else:
            trainer = Trainer(**kwargs)
        times = StepTimes()
        trainer.add_callback(times)
        trainer.train()
        if mode.startswith(("compiled", "captured")):
            result[f"{mode}_first_step_s"] = round(times.seconds[0], 2)
        result[f"{mode}_ms"] = statistics.median(times.seconds[4:]) * 1e3
        if mode.startswith("captured"):
            result[f"{mode}_traces"] = trainer.dp_capture.traces
    for over, under in (("captured_dp", "compiled_plain"), ("captured_dp_pieces", "compiled_plain"),
                        ("eager_dp", "captured_dp"), ("eager_dp", "captured_dp_pieces"), ("eager_dp", "eager_plain")):
        if f"{over}_ms" in result and f"{under}_ms" in result:
            result[f"{over}_over_{under}"] = result[f"{over}_ms"] / result[f"{under}_ms"]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
