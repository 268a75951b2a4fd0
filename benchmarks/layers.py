"""Per-layer forward+backward time and peak memory: non-private against per-sample modes.

    python benchmarks/layers.py [--layers linear conv ...] [--batch 64] [--repeats 20]

Input shapes follow Opacus' layer benchmark rules: ``(batch, *input_shape, in_features)`` for
linear, ``(batch, in_channels, *input_shape)`` for conv, ``(batch, *input_shape)`` for embedding,
``(batch, num_features, *input_shape)`` for instancenorm, ``(batch, num_channels, *input_shape)``
for groupnorm. A private step here is forward, backward and the per-sample norms with the clipped
sum (what the DP optimizer asks of the controller), without noise or the optimizer update.
Time is the median over ``--repeats``; peak memory is the peak of live tensor bytes during one
step, from the profiler's allocation events (the profiler's own messages are silenced). Writes
layers.json into a fresh folder (``--out-dir``; printed at the end), or into benchmarks/results/
with ``--update-committed``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, Tuple

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dptorch.grad_sample import GradSampleHooks

try:
    from benchmarks.output_place import RESULTS, OutputPlace, add_output_flags
except ImportError:  # run as a script: benchmarks/ is on the path
    from output_place import RESULTS, OutputPlace, add_output_flags


def layer_configs(batch: int) -> Dict[str, Tuple[Callable[[], nn.Module], Callable[[], tuple]]]:
    """name -> (module factory, input factory)."""
    from dptorch.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention

    seq = 64
    return {
        "linear": (lambda: nn.Linear(512, 512), lambda: (torch.randn(batch, seq, 512),)),
        "conv": (lambda: nn.Conv2d(64, 64, 3, padding=1), lambda: (torch.randn(batch, 64, 32, 32),)),
        "layernorm": (lambda: nn.LayerNorm(512), lambda: (torch.randn(batch, seq, 512),)),
        "instancenorm": (lambda: nn.InstanceNorm2d(64, affine=True), lambda: (torch.randn(batch, 64, 32, 32),)),
        "groupnorm": (lambda: nn.GroupNorm(16, 64), lambda: (torch.randn(batch, 64, 32, 32),)),
        "embedding": (lambda: nn.Embedding(10000, 512), lambda: (torch.randint(0, 10000, (batch, seq)),)),
        "mha": (lambda: DPMultiheadAttention(100, 4, batch_first=True),
                lambda: (torch.randn(batch, seq, 100), torch.randn(batch, 2 * seq, 100), torch.randn(batch, 2 * seq, 100))),
        "rnn": (lambda: DPRNN(100, 100, batch_first=True), lambda: (torch.randn(batch, seq, 100),)),
        "gru": (lambda: DPGRU(100, 100, batch_first=True), lambda: (torch.randn(batch, seq, 100),)),
        "lstm": (lambda: DPLSTM(100, 100, batch_first=True), lambda: (torch.randn(batch, seq, 100),)),
    }


def first_tensor(output):
    return output[0] if isinstance(output, tuple) else output


def make_step(module: nn.Module, inputs: tuple, mode: str) -> Callable[[], None]:
    if mode == "nonprivate":
        def step():
            module.zero_grad(set_to_none=True)
            first_tensor(module(*inputs)).float().sum().backward()
        return step
    hooks = GradSampleHooks(module, grad_sample_mode=mode, loss_reduction="sum")

    def consume(h):
        norms = h.per_sample_norms()
        flat = torch.stack(list(norms.values())).pow(2).sum(0).sqrt()
        factor = (1.0 / (flat + 1e-6)).clamp(max=1.0)
        h.clipped_sums({p: factor for p in norms})

    hooks.add_backward_listener(consume)

    def step():
        module.zero_grad(set_to_none=True)
        hooks.clear()
        first_tensor(module(*inputs)).float().sum().backward()
    return step


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2 for the block: the profiler's C++ side prints start/stop lines and
    allocator warnings there, which would interleave with the table."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(step: Callable[[], None]) -> int:
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure(name: str, mode: str, batch: int, repeats: int) -> dict:
    make_module, make_inputs = layer_configs(batch)[name]
    torch.manual_seed(0)
    module, inputs = make_module().train(), make_inputs()
    step = make_step(module, inputs, mode)
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"layer": name, "mode": mode, "batch": batch, "median_ms": 1000 * statistics.median(times),
            "peak_mib": peak_bytes(step) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layers = list(layer_configs(1))
    parser.add_argument("--layers", nargs="+", default=layers, choices=layers, metavar="LAYER",
                        help=f"layers to measure, any of: {', '.join(layers)} (default: all)")
    parser.add_argument("--modes", nargs="+", default=["nonprivate", "hooks", "bk", "ew"], metavar="MODE",
                        choices=["nonprivate", "hooks", "bk", "ghost", "ew", "functorch"],
                        help="nonprivate and per-sample modes: hooks, bk, ghost, ew, functorch (default: nonprivate "
                        "hooks bk ew); ratios are against the first one given")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per layer and mode; the median is shown (default 20)")
    add_output_flags(parser, "benchmarks/results/layers.json")
    args = parser.parse_args()
    place = OutputPlace(args, "layers")
    rows = []
    print(f"{'layer':13s} {'mode':11s} {'time ms':>9s} {'x':>6s} {'peak MiB':>9s} {'x':>6s}   (batch {args.batch}, {torch.get_num_threads()} threads)")
    for name in args.layers:
        base = None
        for mode in args.modes:
            try:
                row = measure(name, mode, args.batch, args.repeats)
            except (RuntimeError, ValueError) as err:
                print(f"{name:13s} {mode:11s} not supported: {str(err).splitlines()[-1][:80]}", flush=True)
                continue
            base = base or row
            row["time_ratio"] = row["median_ms"] / base["median_ms"]
            row["memory_ratio"] = row["peak_mib"] / max(base["peak_mib"], 1e-9)
            rows.append(row)
            print(f"{name:13s} {mode:11s} {row['median_ms']:9.2f} {row['time_ratio']:6.2f} {row['peak_mib']:9.1f} {row['memory_ratio']:6.2f}", flush=True)
    place.file("layers.json", RESULTS / "layers.json").write_text(json.dumps(rows, indent=1))
    place.report()


if __name__ == "__main__":
    main()
