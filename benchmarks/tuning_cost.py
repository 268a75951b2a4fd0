"""What choosing hyperparameters on the private data costs: the epsilon of releasing the best of a random
number of trials (Papernot and Steinke 2022), for trials of epsilon 1, 4 and 8 and 10 to 100 expected trials.

    .venv/bin/python benchmarks/tuning_cost.py [--plot docs/images/tuning-cost.png]

One trial is the MiniLM example's run (q = 0.064, 48 steps, delta = 1e-5; docs/choosing-hyperparameters.md),
its noise calibrated so that the run alone reports epsilon 1, 4 or 8 (the default 'pld' accountant). Prints two
Markdown tables: the release's epsilon for each distribution of the number of trials, and the per-trial epsilon
to train at so that the release stays within 1, 4 or 8.
"""

from __future__ import annotations

import argparse

from dptorch.accounting import get_noise_multiplier
from dptorch.accounting.tuning import POISSON
from dptorch.tuning import distribution_name, selection_report

SAMPLE_RATE, STEPS, DELTA = 0.064, 48, 1e-5
EPSILONS = (1.0, 4.0, 8.0)
MEANS = (10, 20, 50, 100)
SHAPES = (POISSON, 0, 1)


def one_trial(sigma: float):
    return [(sigma, SAMPLE_RATE, STEPS)]


def release_epsilon(sigma: float, mean: float, shape: float) -> dict:
    return selection_report(one_trial(sigma), expected_trials=mean, shape=shape, delta=DELTA)


def per_trial_for_release(target: float, mean: float, shape: float) -> float:
    """The per-trial epsilon (pld) of the smallest noise whose release stays within ``target`` (bisection on sigma)."""
    low, high = 0.3, 200.0
    for _ in range(30):
        sigma = (low * high) ** 0.5
        if release_epsilon(sigma, mean, shape)["epsilon"] > target:
            low = sigma
        else:
            high = sigma
    return release_epsilon(high, mean, shape)["per_trial_epsilon"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="write the release's epsilon against the expected trials to this PNG")
    options = parser.parse_args()
    sigmas = {eps: get_noise_multiplier(target_epsilon=eps, target_delta=DELTA, sample_rate=SAMPLE_RATE,
                                        steps=STEPS) for eps in EPSILONS}
    print(f"One trial: q = {SAMPLE_RATE}, {STEPS} steps, delta = {DELTA:g}; the release's epsilon (RDP, "
          "selection included):\n")
    print("| one trial: epsilon (pld) | sigma | through RDP | K | " + " | ".join(f"mean {m}" for m in MEANS) + " |")
    print("| --- " * (4 + len(MEANS)) + "|")
    curves = {}
    for eps, sigma in sigmas.items():
        for shape in SHAPES:
            reports = [release_epsilon(sigma, mean, shape) for mean in MEANS]
            curves[(eps, shape)] = [r["epsilon"] for r in reports]
            print(f"| {reports[0]['per_trial_epsilon']:.3g} | {sigma:.4g} | {reports[0]['per_trial_epsilon_rdp']:.3g} "
                  f"| {distribution_name(shape)} | " + " | ".join(f"{r['epsilon']:.3g}" for r in reports) + " |")
    print("\nThe per-trial epsilon (pld) to train at for the release to stay within a target:\n")
    print("| release target | K | " + " | ".join(f"mean {m}" for m in MEANS) + " |")
    print("| --- " * (2 + len(MEANS)) + "|")
    for target in EPSILONS:
        for shape in SHAPES:
            cells = [per_trial_for_release(target, mean, shape) for mean in MEANS]
            print(f"| {target:g} | {distribution_name(shape)} | " + " | ".join(f"{c:.3g}" for c in cells) + " |")
    if options.plot:
        draw(curves, options.plot)


def draw(curves: dict, path: str) -> None:
    import matplotlib  # optional dependency (the plot extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {POISSON: "-", 0: "--", 1: ":"}
    for (eps, shape), values in curves.items():
        ax.plot(MEANS, values, styles[shape], marker="o", color={1.0: "C0", 4.0: "C1", 8.0: "C2"}[eps],
                label=f"one trial eps {eps:g}, K {distribution_name(shape)}")
    for eps in EPSILONS:
        ax.axhline(eps, color="grey", linewidth=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(MEANS, [str(m) for m in MEANS])
    ax.set_yticks([1, 2, 4, 8, 16, 32, 64], ["1", "2", "4", "8", "16", "32", "64"])
    ax.set_xlabel("expected number of trials")
    ax.set_ylabel(f"epsilon of the best trial's release (delta {DELTA:g})")
    ax.set_title("What tuning costs (Papernot-Steinke, RDP)")
    ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
