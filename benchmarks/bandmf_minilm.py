"""DP-BandMF against DP-SGD on the MiniLM default job (``make demo``), at the same epsilon, over seeds.

``python benchmarks/bandmf_minilm.py --epsilons 1 3 8 --bands 2 4 --seeds 0 1 2`` runs
:func:`dptorch.cli.examples.minilm.run` (the demo's defaults: 2000 training tweets, batch 128, 3 epochs = 48 steps, lr 2e-2, LoRA in the top layer, clipping 1.0, delta 1e-5) without the
non-private baseline, once with independent noise and once per band count with
``noise_mechanism="bandmf"``; only the mechanism differs. The seed moves the data split, the
initialisation, the sampling and the noise, the same way for every mechanism. One thread per run,
1.5 to 3 minutes each on a 2-core CPU: the documented grid (36 runs) takes one to two hours, with a
progress line after each run. The runs file and the figure go to a fresh folder (``--out-dir``,
printed at the end), or with ``--update-committed`` to ``benchmarks/results/bandmf_minilm.jsonl``
and ``docs/images/bandmf-minilm.png``. ``--summarise runs.jsonl`` prints the table and draws it.
"""

from __future__ import annotations

import argparse

try:
    from benchmarks import bandmf_common as common
except ImportError:  # run as a script: benchmarks/ is on the path
    import bandmf_common as common

from dptorch.cli.examples.minilm import run

NAME = "bandmf_minilm"


def one_run(epsilon, mechanism, bands, seed, epochs=3.0, train_size=2000, lr=2e-2, threads=1):
    report = run(epsilon=epsilon, epochs=epochs, train_size=train_size, lr=lr, seed=seed, noise_mechanism=mechanism,
                 bands=bands, threads=threads, baseline=False, verbose=False)
    return {"accuracy": report["private_accuracy"], "epsilon": report["epsilon"],
            "noise_multiplier": report["noise_multiplier"], "sample_rate": report["sample_rate"],
            "steps": report["steps"], "bands": report.get("bands", 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_grid_flags(parser, epsilons=[8.0], bands=["2", "4"], name=NAME)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=2e-2, help="learning rate of every run (the demo's: 2e-2)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    place = common.OutputPlace(args, NAME)
    if args.summarise:
        runs = common.read_runs(args.summarise)
    else:
        runs = common.run_grid(one_run, args, place, NAME, epochs=args.epochs, train_size=args.train_size, lr=args.lr,
                               threads=args.threads)
    common.finish(runs, place, NAME, "MiniLM on tweets (make demo job): DP-BandMF vs DP-SGD")


if __name__ == "__main__":
    main()
