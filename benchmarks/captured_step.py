"""The captured private step on the path users take, against the compiled plain step (issue "The compiled private step").

    python benchmarks/captured_step.py [--shape dispatch-gpt2] [--batch 1] [--seq 4] [--steps 20]
    python benchmarks/captured_step.py --device cuda --dtype bfloat16 --shape gpt2-small --batch 16 --seq 1024
    python benchmarks/captured_step.py --device cuda --dtype bfloat16 --shape llama-1b --lora 16 --batch 8 --seq 1024

GPT-2 (or a Llama of Llama 3.2 1B's shape: 16 x 2048, 8 key-value heads, vocabulary 128256), its head tied,
random weights, trained on token ids with cross-entropy (sum over tokens), SGD; ``--lora R``: LoRA adapters
of rank R on every linear layer (peft), only they trained. Every step is timed whole, taking its batch
from a loader: ``next`` of the loader's iterator, the step, the update.

* ``eager_plain`` / ``compiled_plain``: a shuffling ``DataLoader`` of ``--batch`` rows; the model, or
  ``torch.compile`` of it; forward, backward, ``SGD.step``.
* ``eager_bk``: ``make_private(..., grad_sample_mode="bk", wrap_model=False)`` with a
  ``TruncatedPoissonDataLoader`` of at most ``--batch`` rows (expected ``--batch / 2`` real ones, padded to
  ``--batch``); forward, backward, ``optimizer.step()``.
* ``captured_bk``: the same, with ``capture_step(optimizer, loss_fn)``: forward, backward and clipping
  one compiled graph; ``optimizer.step()`` (the library's noise and accounting, SGD) after it.

On the CPU one thread; on CUDA every timing synchronizes the device. Medians of ``--steps`` steps after
three warm-up steps; the first step of each compiled mode is reported apart (``*_first_step_s``: the
trace and the compilation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from benchmarks.models import build, with_lora
except ImportError:  # run as a script: benchmarks/ is on the path
    from models import build, with_lora

SHAPES = {  # name: (family, layers, width, vocab, key-value heads), the head tied to the token embedding
    "dispatch-gpt2": ("gpt2", 12, 64, 5000, None),
    "narrow-gpt2": ("gpt2", 4, 256, 5000, None),
    "narrow-llama": ("llama", 4, 256, 5000, 2),
    "gpt2-small": ("gpt2", 12, 768, 50257, None),  # for --device cuda
    "llama-1b": ("llama", 16, 2048, 128256, 8),  # for --device cuda, with --lora 16
}


class Timer:
    """Whole steps, each from the loader's next batch to the update; restarts the loader at its end."""

    def __init__(self, loader, step, sync) -> None:
        self.loader, self.step, self.sync = loader, step, sync
        self.batches = iter(loader)

    def one(self) -> float:
        self.sync()
        start = time.perf_counter()
        batch = next(self.batches, None)
        if batch is None:
            self.batches = iter(self.loader)
            batch = next(self.batches)
        self.step(batch)
        self.sync()
        return time.perf_counter() - start

    def median_ms(self, steps: int) -> float:
        for _ in range(3):
            self.one()
        return statistics.median(self.one() for _ in range(steps)) * 1e3


def peak_mib(cuda: bool):
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if cuda else None


def main() -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from dptorch import PrivacyEngine
    from dptorch.data import TruncatedPoissonDataLoader
    from dptorch.optim.captured_step import capture_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dispatch-gpt2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--lora", type=int, default=0, help="LoRA adapters of this rank, only they trained (0: none)")
    parser.add_argument("--rows-per-replay", type=int, default=None,
                        help="captured_bk runs each padded batch as replays of this many rows (pieces of padding alone "
                        "are not replayed); default: one replay of --batch rows")
    parser.add_argument("--modes", nargs="+", default=["eager_plain", "compiled_plain", "eager_bk", "captured_bk"])
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if not cuda:
        torch.set_num_threads(1)
    family, layers, width, vocab, kv_heads = SHAPES[args.shape]
    examples = 64 * args.batch
    ids = torch.randint(0, vocab, (examples, args.seq), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(ids)
    result = {"shape": args.shape, "batch": args.batch, "seq": args.seq, "device": args.device, "dtype": args.dtype,
              "lora": args.lora, "threads": None if cuda else 1}
    if cuda:
        result["device_name"] = torch.cuda.get_device_name()

    def model_and_loss():
        torch.manual_seed(0)
        model = build(family, layers, width, vocab, True, kv_heads)
        model = with_lora(model.to(device=args.device, dtype=getattr(torch, args.dtype)), args.lora)

        def loss_fn(x):
            x = x.to(args.device)
            logits = model(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), x, reduction="sum")

        return model.train(), loss_fn

    for mode in args.modes:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model, loss_fn = model_and_loss()
        sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        if mode.endswith("plain"):
            call = torch.compile(model) if mode == "compiled_plain" else model

            def loss_of(x, call=call):
                logits = call(input_ids=x.to(args.device)).logits
                return torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), x.to(args.device),
                                                         reduction="sum")

            def step(batch, loss_of=loss_of, optimizer=sgd):
                optimizer.zero_grad(set_to_none=True)
                loss_of(batch[0]).backward()
                optimizer.step()

            loader = DataLoader(data, batch_size=args.batch, shuffle=True)
        else:
            engine = PrivacyEngine(accountant="pld")
            truncated = TruncatedPoissonDataLoader(data, sample_rate=args.batch / 2 / examples,
                                                   max_batch_size=args.batch, seed=0)
            _, optimizer, loader = engine.make_private(
                module=model, optimizer=sgd, data_loader=truncated, noise_multiplier=1.0, max_grad_norm=1.0,
                loss_reduction="sum", grad_sample_mode="bk", wrap_model=False)
            captured = (capture_step(optimizer, loss_fn, rows_per_replay=args.rows_per_replay)
                        if mode == "captured_bk" else None)

            def step(batch, optimizer=optimizer, captured=captured, loss_fn=loss_fn):
                optimizer.zero_grad(set_to_none=True)
                if captured is not None:
                    captured(*batch)
                else:
                    loss_fn(batch[0]).backward()
                optimizer.step()

        timer = Timer(loader, step, sync)
        if mode.startswith(("compiled", "captured")):
            result[f"{mode}_first_step_s"] = timer.one()
        result[f"{mode}_ms"] = timer.median_ms(args.steps)
        if cuda:
            result[f"{mode}_peak_mib"] = peak_mib(cuda)
        if mode == "captured_bk":
            result["captured_bk_traces"] = captured.traces
            result["captured_bk_rows_per_replay"] = args.rows_per_replay
        if not mode.endswith("plain"):
            engine.detach()
    if "captured_bk_ms" in result and "compiled_plain_ms" in result:
        result["captured_bk_over_compiled_plain"] = result["captured_bk_ms"] / result["compiled_plain_ms"]
    if "captured_bk_ms" in result and "eager_bk_ms" in result:
        result["eager_bk_over_captured_bk"] = result["eager_bk_ms"] / result["captured_bk_ms"]
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
