"""Throughput of Gaussian noise: default torch generator vs secure (os.urandom) mode.

Run: .venv/bin/python benchmarks/noise.py
"""

from __future__ import annotations

import argparse
import time

import torch

from dptorch.noise import NoiseGenerator, gaussian_noise


def draws_per_second(draw, count: int, repeats: int) -> float:
    """Best-of-``repeats`` throughput of ``draw(reference)`` for a ``count``-element reference."""
    reference = torch.empty(count)
    draw(reference)  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        draw(reference)
        best = min(best, time.perf_counter() - start)
    return count / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7], metavar="N",
                        help="numbers of values drawn at once (default 1000000 10000000)")
    parser.add_argument("--repeats", type=int, default=3, help="draws per size; the fastest counts (default 3)")
    args = parser.parse_args()
    generator = NoiseGenerator(seed=0)
    modes = {
        "default (torch.Generator)": lambda ref: generator.noise_like(ref, 1.0),
        "secure (os.urandom, 4 summands)": lambda ref: gaussian_noise(ref, 1.0, secure=True),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for count in args.sizes:
        rates = {name: draws_per_second(draw, count, repeats=args.repeats) for name, draw in modes.items()}
        default_rate, secure_rate = rates.values()
        for name, rate in rates.items():
            print(f"{count:>9,d} draws  {name:<32s} {rate / 1e6:9.1f} M draws/s")
        print(f"{count:>9,d} draws  secure is {default_rate / secure_rate:.0f}x slower")


if __name__ == "__main__":
    main()
