"""Secure vs default randomness: Gaussian noise vectors and Poisson sampling, median of repeats.

Default: torch's generator through ``NoiseGenerator`` and the seeded ``PoissonBatchSampler``.
Secure: ``SecureNoiseGenerator`` (AES-256-CTR keyed from ``os.urandom``, float64 Box-Muller rounded
to float32) and ``PoissonBatchSampler(secure=True)``. With ``--device cuda`` the default noise is
drawn on the GPU and the secure noise on the host, into pinned memory, copied asynchronously (no
vetted AES for the GPU is used); each timing ends with a device synchronisation.

Run: .venv/bin/python benchmarks/noise.py [--device cuda] [--sizes 19000000 100000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict

import torch

from dptorch.data.poisson import PoissonBatchSampler
from dptorch.noise import NoiseGenerator, SecureNoiseGenerator


def seconds(run: Callable[[], object], device: torch.device) -> float:
    """Wall time of one ``run()``, synchronising ``device`` at the end."""
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def compare(name: str, runs: Dict[str, Callable[[], object]], repeats: int, device: torch.device) -> float:
    """Median time of each run (one warm-up each, then the modes alternate, so load hits both alike).

    Prints both medians and the ratio secure / default, and returns the ratio.
    """
    times: Dict[str, list] = {mode: [] for mode in runs}
    for mode, run in runs.items():
        seconds(run, device)
    for _ in range(repeats):
        for mode, run in runs.items():
            times[mode].append(seconds(run, device))
    median = {mode: statistics.median(values) for mode, values in times.items()}
    ratio = median["secure"] / median["default"]
    print(f"{name:<34s} default {median['default']:8.4f} s  secure {median['secure']:8.4f} s  "
          f"secure/default {ratio:5.2f}x")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[19_000_000, 100_000_000], metavar="N",
                        help="noise vector lengths (default 19000000 100000000)")
    parser.add_argument("--units", type=int, default=10**6, help="units the Poisson sampler draws from (default 10^6)")
    parser.add_argument("--sample-rate", type=float, default=0.01, help="Poisson sample rate (default 0.01)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the median counts (default 5)")
    parser.add_argument("--device", default="cpu", help="where the noise goes: cpu or cuda (default cpu)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA build of torch and a visible GPU")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}, "
          f"median of {args.repeats}")
    default, secure = NoiseGenerator(seed=0, device=device), SecureNoiseGenerator()
    for count in args.sizes:
        reference = torch.empty(count, device=device)
        compare(f"noise, {count:,d} float32 values", {
            "default": lambda: default.noise_like(reference, 1.0),
            "secure": lambda: secure.noise_like(reference, 1.0),
        }, args.repeats, device)
        del reference
    samplers = {"default": PoissonBatchSampler(args.units, args.sample_rate, seed=0),
                "secure": PoissonBatchSampler(args.units, args.sample_rate, secure=True)}
    compare(f"Poisson draw, {args.units:,d} units", {mode: sampler.draw for mode, sampler in samplers.items()},
            args.repeats, torch.device("cpu"))


if __name__ == "__main__":
    main()
