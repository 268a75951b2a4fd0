"""DP-BandMF against DP-SGD on the digits example, at the same epsilon, over seeds.

``python benchmarks/bandmf_digits.py --epsilons 0.5 1 2 4 8 --bands 2 4 auto --seeds 0 1 2`` trains
the digits CNN of :mod:`dptorch.cli.examples.digits` (1437 training images, batch 128, 20 epochs =
240 steps, SGD lr 0.1 momentum 0.9, flat clipping 1.0, delta 1e-5, PLD) once with independent
noise and once per band count with ``noise_mechanism="bandmf"``; only the mechanism
(and so the sampling and the calibrated sigma) differs. ``auto`` takes the b of
:func:`dptorch.noise.banded.choose_bands` (DP-SGD when it picks 1). ``--workload momentum``
optimises the band (and the ``auto`` choice) for SGD with the run's momentum instead of plain
prefix sums. Prints one JSON line per run and appends it to the runs file, then the table and
the figure: in a fresh folder (``--out-dir``), or the committed ``benchmarks/results/bandmf_digits.jsonl``
and ``docs/images/bandmf-digits.png`` with ``--update-committed``.

Sigma is calibrated here with ``get_noise_multiplier`` at the loader's rate for the accounted
steps (``ceil(n / b)`` at ``q_p`` for bandmf) and passed to ``make_private``: the same calibration
as ``make_private_with_epsilon``, whose bandmf plan (before the fix of ``PrivacyPlan.expected_batch_size``)
divided the noised sum by ``q_p N = b B`` instead of ``B``, i.e. trained at ``lr / b``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

try:
    from benchmarks import bandmf_common as common
except ImportError:  # run as a script: benchmarks/ is on the path
    import bandmf_common as common

from dptorch import PrivacyEngine
from dptorch.accounting import get_noise_multiplier
from dptorch.data.cyclic_poisson import CyclicPoissonDataLoader
from dptorch.data.poisson import DPDataLoader
from dptorch.cli.examples.digits import accuracy, digits_cnn, load_digits_splits
from dptorch.noise.banded import SGDWorkload, accounted_steps, choose_bands, optimal_banded_strategy

NAME = "bandmf_digits"


def one_run(epsilon, mechanism, bands, seed, epochs=20, batch_size=128, lr=0.1, momentum=0.9, delta=1e-5,
            workload="prefix"):
    torch.set_num_threads(1)
    train_set, test_set = load_digits_splits(0)  # the example's fixed split; the seed moves init, sampling, noise
    plain = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    target = SGDWorkload(momentum=momentum) if workload == "momentum" else SGDWorkload()
    if bands == "auto":
        bands = choose_bands(target_epsilon=epsilon, target_delta=delta, steps=epochs * len(plain),
                             sample_rate=1 / len(plain), workload=target).bands
        mechanism = "bandmf" if bands > 1 else "independent"
    torch.manual_seed(seed)
    if mechanism == "bandmf":
        loader = CyclicPoissonDataLoader.from_data_loader(plain, bands=bands)
    else:
        loader, bands = DPDataLoader.from_data_loader(plain), 1
    steps = epochs * len(plain)  # the same for every mechanism (a cyclic epoch is rounded up to a multiple of b)
    sigma = get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=loader.batch_sampler.sample_rate,
                                 steps=accounted_steps(steps, bands))
    model = digits_cnn()
    engine = PrivacyEngine()
    _hooks, optimizer, loader = engine.make_private(  # wrap_model=False: the controller; `model` trains itself
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), data_loader=loader,
        noise_multiplier=sigma, max_grad_norm=1.0, wrap_model=False, noise_mechanism=mechanism,
        bands=bands if mechanism == "bandmf" else None, planned_steps=steps,
    )
    if mechanism == "bandmf" and workload == "momentum":  # the band for SGD with momentum (same bands, norm 1)
        engine.plan.strategy = optimizer.noise_generator.strategy = optimal_banded_strategy(steps, bands, workload=target)
    criterion = nn.CrossEntropyLoss()
    taken = 0
    while taken < steps:
        for x, y in loader:
            optimizer.zero_grad()
            if len(y):
                criterion(model(x), y).backward()
            optimizer.step()
            taken += 1
            if taken == steps:
                break
    return {"accuracy": accuracy(model, test_set), "epsilon": engine.get_epsilon(delta), "noise_multiplier": sigma,
            "sample_rate": engine.plan.sample_rate, "steps": taken, "bands": bands,
            "expected_batch_size": optimizer.expected_batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_grid_flags(parser, epsilons=[0.5, 1.0, 2.0, 4.0, 8.0], bands=["2", "4"], name=NAME)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workload", choices=["prefix", "momentum"], default="prefix",
                        help="what the band (and bands 'auto') is optimised for (default: prefix sums)")
    args = parser.parse_args()
    place = common.OutputPlace(args, NAME)
    if args.summarise:
        runs = common.read_runs(args.summarise)
    else:
        runs = common.run_grid(one_run, args, place, NAME, epochs=args.epochs, lr=args.lr, workload=args.workload)
    common.finish(runs, place, NAME, "digits CNN (240 steps, lr 0.1, momentum 0.9): DP-BandMF vs DP-SGD")


if __name__ == "__main__":
    main()
