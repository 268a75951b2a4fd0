"""Peak RSS and step time through ``make_private`` with its DP loader: the path users take.

    python benchmarks/engine_memory.py --shape narrow-llama --mode bk --steps 10
    MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/engine_memory.py --mode bk   # glibc's threshold fixed

One run of ``models.measure_engine`` (what ``benchmarks/models.py`` runs for every shape and mode):
``--mode plain`` runs the same model and SGD without dptorch on the same Poisson draws (seed 0). Prints,
per step, the RSS after it, the step's peak RSS and its time (MiB, MiB, ms), then the peak over the steps
and the median time of the steps after the first two. The Poisson batch varies, so single steps spread;
compare medians of alternating runs.
"""

from __future__ import annotations

import argparse
import statistics

import torch

try:
    from benchmarks.models import SHAPES, measure_engine
except ImportError:  # run as a script: benchmarks/ is on the path
    from models import SHAPES, measure_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="narrow-gpt2-untied", choices=sorted(SHAPES))
    parser.add_argument("--mode", default="bk", help="plain, or a grad_sample_mode (bk, hooks, ...)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = measure_engine(args.shape, "nonprivate" if args.mode == "plain" else args.mode, args.steps, None, None)
    steps = [(r["after_mib"], r["peak_mib"], r["ms"]) for r in run["steps"]]
    print(f"{args.mode} {args.shape}: (RSS after, step peak RSS, MiB; ms) per step {steps}")
    print(f"peak {run['peak_mib']} MiB, median step {statistics.median(s[2] for s in steps[2:]):.0f} ms")


if __name__ == "__main__":
    main()
