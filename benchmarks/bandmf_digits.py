"""DP-BandMF against DP-SGD on the digits example, at the same epsilon, over seeds.

``python -m benchmarks.bandmf_digits --epsilons 1 3 8 --bands 4 --seeds 0 1 2`` trains the digits CNN
of :mod:`dptorch.examples.digits` with ``make_private_with_epsilon`` (same epochs, batch size, lr,
momentum, clipping) once with independent noise and once with ``noise_mechanism="bandmf"`` for each
band count, and prints the test accuracy (mean and spread over seeds) as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from dptorch import PrivacyEngine
from dptorch.examples.digits import accuracy, digits_cnn, load_digits_splits


def one_run(epsilon, mechanism, bands, seed, epochs=20, batch_size=128, lr=0.1, delta=1e-5):
    torch.set_num_threads(1)
    train_set, test_set = load_digits_splits(0)  # the example's fixed split; the seed moves init, sampling, noise
    torch.manual_seed(seed)
    model = digits_cnn()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        data_loader=DataLoader(train_set, batch_size=batch_size, shuffle=True), target_epsilon=epsilon,
        target_delta=delta, epochs=epochs, max_grad_norm=1.0, wrap_model=False,
        noise_mechanism=mechanism, bands=bands,
    )
    criterion = nn.CrossEntropyLoss()
    total = epochs * len(loader)
    taken = 0
    while taken < total:
        for x, y in loader:
            optimizer.zero_grad()
            if len(y):
                criterion(model(x), y).backward()
            optimizer.step()
            taken += 1
            if taken == total:
                break
    return {"accuracy": accuracy(model, test_set), "epsilon": engine.get_epsilon(delta),
            "noise_multiplier": engine.noise_multiplier, "sample_rate": engine.plan.sample_rate, "steps": taken}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epsilons", type=float, nargs="+", default=[3.0])
    parser.add_argument("--bands", type=int, nargs="+", default=[4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    for epsilon in args.epsilons:
        for mechanism, bands in [("independent", None)] + [("bandmf", b) for b in args.bands]:
            start = time.perf_counter()
            runs = [one_run(epsilon, mechanism, bands, seed, epochs=args.epochs) for seed in args.seeds]
            accs = [r["accuracy"] for r in runs]
            print(json.dumps({
                "epsilon_target": epsilon, "mechanism": mechanism, "bands": bands or 1,
                "accuracy_mean": statistics.mean(accs), "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "accuracies": accs, "epsilon": runs[0]["epsilon"], "noise_multiplier": runs[0]["noise_multiplier"],
                "sample_rate": runs[0]["sample_rate"], "steps": runs[0]["steps"],
                "seconds": round(time.perf_counter() - start, 1),
            }), flush=True)


if __name__ == "__main__":
    main()
