"""What the guard of operations run with torch functions off (``tracking/unseen.py``) costs a step.

    python benchmarks/unseen_guard.py --shape tiny-gpt2 --rounds 3

Runs ``benchmarks/engine_memory.py`` (``make_private`` with its DP loader, bk) in fresh processes,
alternately as shipped and with the guard kept off the dispatch stack (a measurement only: the guard is
what refuses those operations), and prints each run's median step time and their ratio. Time it alone on
a quiet machine. docs/performance.md quotes the figures.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WITHOUT = ("import sys, dptorch.grad_sample.tracking.unseen as u; u._live_trackers = lambda: []; "
           f"sys.path.insert(0, {str(HERE)!r}); import engine_memory; sys.argv = ['engine_memory'] + sys.argv[1:]; "
           "engine_memory.main()")


def median_ms(command: list) -> float:
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"median step (\d+) ms", out).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny-gpt2")
    parser.add_argument("--mode", default="bk")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rest = ["--shape", args.shape, "--mode", args.mode, "--steps", str(args.steps), "--threads", "1"]
    for r in range(args.rounds):
        shipped = median_ms([sys.executable, str(HERE / "engine_memory.py"), *rest])
        without = median_ms([sys.executable, "-c", WITHOUT, *rest])
        print(f"round {r}: {args.shape} {args.mode}: with the guard {shipped:.0f} ms, without {without:.0f} ms, "
              f"ratio {shipped / without:.3f}")


if __name__ == "__main__":
    main()
