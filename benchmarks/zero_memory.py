"""Memory per rank of a private DeepSpeed ZeRO step: the clipped sums held between micro-batches, and peaks.

    python benchmarks/zero_memory.py [--processes 2] [--stage 3]

Trains 8 ``nn.Linear(2048, 2048)`` (33.6 M parameters, fp32) privately under ZeRO-1, 2 or 3 (CPU, gloo; ZeRO-3:
every parameter partitioned; ``grad_sample_mode="bk"``), Poisson batches of 32 expected rows split into physical
batches of 4 rows per rank (3 or 4 micro-batches per step). Under ZeRO-3 DeepSpeed's own live-parameter bound is set
to about one layer, as a model far larger than its defaults (1e9 elements) would see. Prints, per rank: the most bytes of clipped sums the DP
optimizer held after a backward pass, the peak growth of live tensor bytes (``torch.profiler`` memory events) over
one micro-batch's forward and backward, over ``step()``, and over a whole logical step. Memory figures only: the
timings of a shared machine mean nothing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTH, LAYERS, ROWS, RATE, PHYSICAL = 2048, 8, 256, 0.125, 4
LIVE = {"stage3_max_live_parameters": 5e6, "stage3_max_reuse_distance": 5e6, "stage3_prefetch_bucket_size": 5e6}


def events_peak_mib(prof) -> float:
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def worker(out: Path, stage: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from dptorch import BatchMemoryManager, PrivacyEngine
    from dptorch.data import DPDataLoader

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # inference only; minutes to build
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **LIVE} if stage == 3 else
              {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                  config=config)[0]
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g))
    privacy = PrivacyEngine(accountant="rdp")
    _, optimizer, loader = privacy.make_private(
        module=engine, optimizer=engine.optimizer, noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="bk",
        loss_reduction="sum",
        data_loader=DPDataLoader(data, sample_rate=RATE, seed=3, distributed=True))

    def profiled(run) -> float:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        return events_peak_mib(prof)

    def backward(x, y) -> None:
        engine.backward(((engine(x) - y) ** 2).sum())

    report = {"parameters_mib": sum(getattr(p, "ds_numel", p.numel()) for p in optimizer.params) * 4 / 2**20, "held_mib": 0.0,
              "forward_backward_mib": 0.0}
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=PHYSICAL, optimizer=optimizer) as batches:
        batches = iter(batches)
        for step in range(4):  # step 2: each phase profiled alone; step 3: the whole logical step
            whole = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if step == 3 else None
            if whole is not None:
                whole.__enter__()
            while True:
                x, y = next(batches)
                if step == 2:
                    report["forward_backward_mib"] = max(report["forward_backward_mib"], profiled(lambda: backward(x, y)))
                else:
                    backward(x, y)
                report["held_mib"] = max(report["held_mib"],
                                         sum(t.numel() * t.element_size() for t in optimizer._summed.values()) / 2**20)
                last = not optimizer._step_skip_queue or not optimizer._step_skip_queue[0]
                if step == 2 and last:
                    report["step_mib"] = profiled(engine.step)
                else:
                    engine.step()
                if last:
                    break
            if whole is not None:
                whole.__exit__(None, None, None)
                report["logical_step_mib"] = events_peak_mib(whole)
    privacy.detach()
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.stage)
    out = Path(tempfile.mkdtemp(prefix=f"dptorch-bench-zero{args.stage}-memory-"))
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.processes}",
                    __file__, "--worker", str(out), "--stage", str(args.stage)], check=True, env=env, stdout=subprocess.DEVNULL)
    print("| rank | clipped sums held (MiB) | peak growth: forward+backward | step() | logical step (MiB) |")
    print("|---|---|---|---|---|")
    for rank in range(args.processes):
        r = json.loads((out / f"rank{rank}.json").read_text())
        print(f"| {rank} | {r['held_mib']:.1f} of {r['parameters_mib']:.1f} | {r['forward_backward_mib']:.1f} "
              f"| {r['step_mib']:.1f} | {r['logical_step_mib']:.1f} |")


if __name__ == "__main__":
    main()
