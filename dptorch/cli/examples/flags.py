"""The command-line flags every example shares (privacy target, clipping, mode, threads, output),
and their checks, run before anything trains."""

from __future__ import annotations

import argparse

from dptorch.accounting.validation import check_delta_for_units, check_epsilon, check_positive
from dptorch.grad_sample.modes.auto import MODES


def add_shared_flags(parser: argparse.ArgumentParser, *, epsilon: float, epochs: float,
                     batch_size_help: str = "expected batch size (default 128)") -> None:
    """Flags for epsilon, delta, epochs, batch size, C, mode, seed, threads, plots, the baseline and JSON."""
    parser.add_argument("--epsilon", type=float, default=epsilon, help=f"target epsilon (default {epsilon:g})")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    parser.add_argument("--epochs", type=type(epochs), default=epochs, help=f"epochs (default {epochs:g})")
    parser.add_argument("--batch-size", type=int, default=128, help=batch_size_help)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C (default 1)")
    parser.add_argument("--mode", default="auto", choices=MODES,
                        help="how per-sample gradients are computed (default auto: bk where a layer has a norm "
                        "sampler, else hooks; the report says which ran; a mode the model cannot use is refused "
                        "before training)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data split, initialisation, sampling and noise")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, on every machine: the figures the docs quote are those of "
                        "one thread, and another count gives another, equally valid, run); 0: the CPUs idle now, "
                        "at most 4 (fastest on a shared machine, but the numbers then depend on its load)")
    parser.add_argument("--plots", metavar="DIR",
                        help="save epsilon.png, loss.png, test_accuracy.png and clipped_fraction.png in DIR")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the non-private run (about half the time); no non-private accuracy or loss curve")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object, without progress")


def check_shared_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, dataset_size: int) -> None:
    """Refuse bad privacy and training flags by their names, before anything loads or trains
    (``parser.error``: usage and exit code 2, as for a flag argparse refuses)."""
    try:
        check_epsilon(args.epsilon, "--epsilon")
        check_delta_for_units(args.delta, dataset_size, "--delta")
        check_positive(args.epochs, "--epochs")
        check_positive(args.max_grad_norm, "--max-grad-norm")
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0: the CPUs idle now), got {args.threads}")
    except ValueError as error:
        parser.error(str(error))
