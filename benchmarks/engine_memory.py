"""Peak RSS and step time through ``make_private`` with its DP loader: the path users take.

    python benchmarks/engine_memory.py --shape narrow-llama --mode bk --steps 10
    MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/engine_memory.py --mode bk   # glibc's threshold fixed

``--mode plain`` runs the same model, loader and SGD without dptorch. Prints, per step, the current RSS,
the process's peak RSS so far (``ru_maxrss``) in MB and the step's time in ms, then the peak and the
median time of the steps after the first two. The Poisson batch varies, so single steps spread; compare
medians of alternating runs. docs/performance.md ("Memory through the engine") quotes these figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

try:
    from benchmarks.models import SHAPES, build
except ImportError:  # run as a script: benchmarks/ is on the path
    from models import SHAPES, build


def current_rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="narrow-gpt2-untied", choices=sorted(SHAPES))
    parser.add_argument("--mode", default="bk", help="plain, or a grad_sample_mode (bk, hooks, ...)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    family, layers, width, seq, batch, vocab, tied, *kv_heads = SHAPES[args.shape]
    torch.manual_seed(0)
    model = build(family, layers, width, vocab, tied, *kv_heads).train()
    ids = torch.randint(0, vocab, (batch * 20, seq))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if args.mode != "plain":
        from dptorch import PrivacyEngine

        _, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode=args.mode, wrap_model=False)
    steps, batches = [], iter(loader)
    while len(steps) < args.steps:
        try:
            (x,) = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        if not len(x):  # an empty Poisson draw (likely at batch 1): HF's models cannot run 0 rows
            continue
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(input_ids=x).logits.transpose(1, 2), x).backward()
        optimizer.step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        steps.append((round(current_rss_mb()), round(peak), round(1000 * (time.perf_counter() - start))))
    print(f"{args.mode} {args.shape}: (rss MB, peak MB, ms) per step {steps}")
    print(f"peak {steps[-1][1]} MB, median step {statistics.median(s[2] for s in steps[2:]):.0f} ms")


if __name__ == "__main__":
    main()
