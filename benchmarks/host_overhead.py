"""Host overhead of a private step at a dispatch-bound shape: forward, backward and optimizer step timed apart.

    python benchmarks/host_overhead.py [--runs 3] [--steps 6] [--modes plain bk hooks opacus-hooks]
    python benchmarks/host_overhead.py --runs 1 --modes plain compiled-plain compiled-bk compiled-hooks
    python benchmarks/host_overhead.py --device cuda --dtype bfloat16 --shapes gpt2-small llama-1b

Default shape: GPT-2, 12 layers of width 64, vocabulary 5000, B = 1, T = 4, where the kernels are
tiny and the step time is what Python issues. Each mode runs in its own process (``--runs``
times); in each, the median of ``--steps`` steps after two warm-up steps, for the forward (model
call), the backward (``loss.backward()``, where the controller's hooks and the per-sample norms run)
and the optimizer step (clipping, accumulation and the update; the noise draw is left out by a
noise multiplier of 0, so the figure is the bookkeeping). Ratios are against ``plain`` (eager
torch, no DP) of the same run; the table gives min / median / max over the runs. Opacus 1.6, an
optional peer (``pip install dptorch[bench]``), runs the same model as ``opacus-hooks``.
The last column counts the operators each phase dispatches to kernels in one more step: the work the
host issues, the same on any machine. Time on a quiet machine: other work beside it inflates the ratios.
Modes ``compiled-plain``, ``compiled-bk``, ``compiled-hooks`` (opt-in; benchmarks/compiled.py) run the model
under ``torch.compile`` (the private ones compiled after the controller is attached) and are compared with
``compiled-plain``; their compile time (the two warm-up steps beyond two median steps) is a column of its
own, with the graphs compiled, the graph breaks, the recompilations after the first step and how far the
first step's logits are from the eager model's (the private ones run their forwards eagerly: docs/performance.md).
Their aten operator counts are not given (under a dispatch mode Dynamo runs the model eagerly).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from benchmarks.compiled import CompileWatch, compile_seconds, describe, max_difference, split_mode
    from benchmarks.models import build, opacus_private
except ImportError:  # run as a script: benchmarks/ is on the path
    from compiled import CompileWatch, compile_seconds, describe, max_difference, split_mode
    from models import build, opacus_private

SHAPES = {
    # name: (family, layers, width, seq, batch, vocab, tied)
    "dispatch-gpt2": ("gpt2", 12, 64, 4, 1, 5000, True),
    "gpt2-small": ("gpt2", 12, 768, 1024, 16, 50257, True),  # for --device cuda
    "llama-1b": ("llama", 16, 2048, 1024, 16, 32000, False),  # for --device cuda
}
PHASES = ("forward", "backward", "step")


def measure(shape: str, mode: str, steps: int, device: str, dtype: str) -> dict:
    """Median seconds of each phase for one (shape, mode), in this process."""
    import warnings

    import torch

    from dptorch.grad_sample import GradSampleHooks
    from dptorch.optim import DPOptimizer

    warnings.simplefilter("ignore")  # noise_multiplier=0's warning: the noise draw is left out on purpose
    family, layers, width, seq, batch, vocab, tied = SHAPES[shape]
    mode, compiled = split_mode(mode)
    torch.manual_seed(0)
    model = build(family, layers, width, vocab, tied).to(device=device, dtype=getattr(torch, dtype)).train()
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    if mode.startswith("opacus"):
        model, optimizer, criterion = opacus_private(model, optimizer, criterion, mode.split("-")[1], batch)
    elif mode != "plain":
        hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum", keep_param_grads=False)
        optimizer = DPOptimizer(optimizer, hooks=hooks, noise_multiplier=0.0, max_grad_norm=1.0,
                                expected_batch_size=batch, loss_reduction="sum")
    watch = CompileWatch() if compiled else None
    call = watch.compile(model) if compiled else model  # after the hooks: make_private(..., wrap_model=False)'s order
    if compiled:
        with torch.no_grad():
            eager_logits = model(input_ids=ids).logits  # what the compiled model's first step must compute
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def timed(run):
        sync()
        start = time.perf_counter()
        out = run()
        sync()
        return out, time.perf_counter() - start

    times, warm_up = {phase: [] for phase in PHASES}, []
    for index in range(steps + 2):
        optimizer.zero_grad()
        logits, forward = timed(lambda: call(input_ids=ids).logits)
        loss = criterion(logits.transpose(1, 2), ids)
        _, backward = timed(loss.backward)
        _, step = timed(optimizer.step)
        if index == 0 and watch:
            watch.first_step_done()
            difference, eager_logits = max_difference(eager_logits, logits), None
        if index >= 2:
            for phase, value in zip(PHASES, (forward, backward, step)):
                times[phase].append(value)
        else:
            warm_up.append(forward + backward + step)
    medians = {phase: statistics.median(v) for phase, v in times.items()}
    result = {"shape": shape, "mode": f"compiled-{mode}" if compiled else mode, **medians,
              "torch_functions_per_forward": count_torch_functions(model, ids)}
    if compiled:  # counting aten ops runs a dispatch mode, under which Dynamo runs the model eagerly
        return {**result, "compile_s": compile_seconds(warm_up, sum(medians.values())), **watch.summary(),
                "forward_max_diff": difference}
    return {**result, "aten_ops": count_aten_ops(model, ids, criterion, optimizer)}


def count_aten_ops(model, ids, criterion, optimizer) -> list:
    """Operators dispatched to kernels in one more step, per phase (forward, backward, step): the work a
    host issues, the same on every machine (as the times are not)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    counts = [Count() for _ in PHASES]
    optimizer.zero_grad()
    with counts[0]:
        logits = model(input_ids=ids).logits
    loss = criterion(logits.transpose(1, 2), ids)
    with counts[1]:
        loss.backward()
    with counts[2]:
        optimizer.step()
    return [c.calls for c in counts]


def count_torch_functions(model, ids) -> int:
    """How many torch functions one forward issues (what a per-operation tracker pays for)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        model(input_ids=ids)
    return Count.calls


def spread(values) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["dispatch-gpt2"], choices=sorted(SHAPES))
    parser.add_argument("--modes", nargs="+", default=["plain", "bk", "hooks", "opacus-hooks"])
    parser.add_argument("--runs", type=int, default=3, help="processes per mode (min / median / max over them)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per process (their median counts)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--one", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], args.steps, args.device, args.dtype)))
        return
    modes = [m for m in args.modes if not m.startswith("opacus") or _has_opacus()]
    skipped = sorted(set(args.modes) - set(modes))
    for shape in args.shapes:
        ratios = {mode: {phase: [] for phase in PHASES} for mode in modes}
        absolute = {mode: {phase: [] for phase in PHASES} for mode in modes}
        calls, last = None, {}
        for _ in range(args.runs):
            run = {}
            for mode in modes:
                command = [sys.executable, __file__, "--one", shape, mode, "--steps", str(args.steps),
                           "--device", args.device, "--dtype", args.dtype]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                run[mode] = last[mode] = json.loads(done.stdout.strip().splitlines()[-1])
                calls = run[mode]["torch_functions_per_forward"]
            for mode in modes:
                reference = run.get(reference_mode(mode))
                for phase in PHASES:
                    absolute[mode][phase].append(1000 * run[mode][phase])
                    if reference is not None:
                        ratios[mode][phase].append(run[mode][phase] / reference[phase])
        print(f"\n{shape} ({calls} torch functions per forward), {args.device} {args.dtype}; "
              f"min / median / max over {args.runs} runs of the median of {args.steps} steps; ratios against plain, "
              "compiled modes' against compiled-plain; compile s: the 2 warm-up steps beyond 2 median steps (last run)")
        print("| mode | forward ms | backward ms | step ms | forward / ref | backward / ref | step / ref "
              "| aten ops (forward / backward / step) | compile s | graphs |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for mode in modes:
            ms = [f"{statistics.median(absolute[mode][phase]):.1f}" for phase in PHASES]
            rs = [spread(ratios[mode][phase]) if ratios[mode][phase] else "-" for phase in PHASES]
            print(f"| {mode} | {' | '.join(ms)} | {' | '.join(rs)} | {compile_cells(last[mode])} |")
    if skipped:
        print(f"\nnot run (not installed): {', '.join(skipped)}")


def reference_mode(mode: str) -> str:
    """What a mode's ratios are against: ``plain``, or ``compiled-plain`` for a compiled mode."""
    return "compiled-plain" if split_mode(mode)[1] else "plain"


def compile_cells(row: dict) -> str:
    """The last three cells of a row: aten ops (eager modes), compile seconds and graphs (compiled modes)."""
    if "compile_s" not in row:
        return " / ".join(str(n) for n in row["aten_ops"]) + " | - | -"
    return f"- | {row['compile_s']:.1f} | {describe(row)}"


def _has_opacus() -> bool:
    import importlib.util

    return importlib.util.find_spec("opacus") is not None


if __name__ == "__main__":
    main()
