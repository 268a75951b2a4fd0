"""The command-line flags every example shares (privacy target, clipping, mode, output)."""

from __future__ import annotations

import argparse
from typing import Sequence


def add_shared_flags(parser: argparse.ArgumentParser, *, epsilon: float, epochs: float, modes: Sequence[str],
                     batch_size_help: str = "expected batch size (default 128)") -> None:
    """Flags for epsilon, delta, epochs, batch size, C, mode, seed, plots, the baseline and JSON."""
    parser.add_argument("--epsilon", type=float, default=epsilon, help=f"target epsilon (default {epsilon:g})")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    parser.add_argument("--epochs", type=type(epochs), default=epochs, help=f"epochs (default {epochs:g})")
    parser.add_argument("--batch-size", type=int, default=128, help=batch_size_help)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C (default 1)")
    parser.add_argument("--mode", default="auto", choices=["auto", *modes],
                        help="how per-sample gradients are computed (default auto: bk where a layer has a norm "
                        "sampler, else hooks; bk here; the report says which ran)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data split, initialisation, sampling and noise")
    parser.add_argument("--plots", metavar="DIR", help="save epsilon.png, loss.png and clipped_fraction.png in DIR")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the non-private run (about half the time); no non-private accuracy or loss curve")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object, without progress")
