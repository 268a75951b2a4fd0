"""Timings and accuracy figures of the privacy accountants; prints a small report.

    .venv/bin/python benchmarks/accounting.py [--quick]

Cold timings: every cache is emptied before each measurement.
"""

from __future__ import annotations

import argparse
import time
import warnings

from dptorch.accounting import calibration, create_accountant, epsilon_curve, get_noise_multiplier
from dptorch.accounting.pld import PLDAccountant, automatic_discretization_interval, sampled_gaussian_pld
from dptorch.accounting.privacy_random_variable import discretise_loss
from dptorch.accounting.sampled_gaussian_rdp import _rdp_cached

NAMES = ["pld", "prv", "rdp", "gdp"]
DELTA = 1e-5


def clear_caches() -> None:
    sampled_gaussian_pld.cache_clear()
    discretise_loss.cache_clear()
    _rdp_cached.cache_clear()
    calibration._calibrate.cache_clear()


def make(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_accountant(name)


def timed(function):
    clear_caches()
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def epsilon_of(name: str, sigma: float, q: float, steps: int) -> float:
    accountant = make(name)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_epsilon(DELTA)


def report_get_epsilon(settings) -> None:
    print(f"get_epsilon, cold (delta = {DELTA:g})")
    print(f"  {'sigma':>6} {'q':>7} {'steps':>7} " + " ".join(f"{n + ' eps':>10} {'s':>6}" for n in NAMES))
    for sigma, q, steps in settings:
        cells = []
        for name in NAMES:
            epsilon, seconds = timed(lambda: epsilon_of(name, sigma, q, steps))
            cells.append(f"{epsilon:10.4f} {seconds:6.2f}")
        print(f"  {sigma:6g} {q:7g} {steps:7d} " + " ".join(cells))


def report_calibration(targets) -> None:
    print("get_noise_multiplier, cold (seconds; sigma)")
    for epsilon, q, steps in targets:
        cells = []
        for name in NAMES:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sigma, seconds = timed(
                    lambda: get_noise_multiplier(
                        target_epsilon=epsilon, target_delta=DELTA, sample_rate=q, steps=steps, accountant=name
                    )
                )
            cells.append(f"{name} {seconds:5.2f}s sigma={sigma:.4f}")
        print(f"  eps {epsilon:g}, q {q:g}, {steps} steps: " + "; ".join(cells))


def report_accuracy(settings) -> None:
    print("PLD automatic interval vs a 10x finer one, and the other accountants vs PLD (relative)")
    for sigma, q, steps in settings:
        interval = automatic_discretization_interval(((sigma, q, steps),))
        fine = PLDAccountant(value_discretization_interval=interval / 10)
        fine.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        reference = fine.get_epsilon(DELTA)
        pld = epsilon_of("pld", sigma, q, steps)
        others = {name: epsilon_of(name, sigma, q, steps) / pld - 1 for name in ("prv", "rdp", "gdp")}
        print(
            f"  sigma {sigma:g}, q {q:g}, {steps} steps: interval {interval:.1e}, pld {pld:.4f} "
            f"({100 * (pld / reference - 1):+.4f}% vs finer); "
            + ", ".join(f"{name} {100 * gap:+.2f}%" for name, gap in others.items())
        )


def report_curves(sigma: float, q: float, steps: int) -> None:
    print(f"epsilon_curve (~50 points), sigma {sigma:g}, q {q:g}, 0..{steps} steps, cold")
    for name in NAMES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (grid, _), seconds = timed(
                lambda: epsilon_curve(name, noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA)
            )
        print(f"  {name}: {len(grid)} points in {seconds:.2f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer settings")
    quick = parser.parse_args().quick

    long_runs = [(1.1, 0.01, 100_000), (0.9, 0.0005, 100_000), (2.0, 0.004, 100_000)]
    typical = [(1.5, 0.04, 2250), (1.0, 0.01, 10_000), (0.8, 0.004, 10_000), (4.0, 0.5, 100)]
    report_get_epsilon(long_runs[:1] if quick else long_runs + typical)
    print()
    targets = [(8.0, 0.04, 2250), (1.0, 0.01, 10_000), (3.0, 0.004, 100_000)]
    report_calibration(targets[:1] if quick else targets)
    print()
    report_accuracy(typical[:2] if quick else typical + [(0.6, 0.004, 1000), (1.1, 0.01, 100_000)])
    print()
    report_curves(1.1, 0.01, 10_000)


if __name__ == "__main__":
    main()
