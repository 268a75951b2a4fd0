"""The ``dptorch`` command line.

    dptorch epsilon --noise-multiplier S --sample-rate Q --steps N --delta D [--accountant pld]
    dptorch noise --target-epsilon E --delta D --sample-rate Q (--epochs E | --steps N)

Adding a subcommand: write ``add_<name>_command(subparsers)`` that creates its parser with
``subparsers.add_parser(...)`` and sets ``handler=run_<name>`` through ``set_defaults``; the
handler takes the parsed arguments and returns the exit code. Append the function to
:data:`COMMANDS`. A ``ValueError`` from a handler is bad input: it is printed as one line
``dptorch: error: ...`` and the exit code is 2. :class:`CommandError` is for other failures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from dptorch.accounting import (
    ACCOUNTANTS,
    DEFAULT_ACCOUNTANT,
    check_accountant_name,
    create_accountant,
    epsilon_curve,
    get_noise_multiplier,
    steps_for_epochs,
)
from dptorch.accounting.validation import (
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_positive,
    check_sample_rate,
    check_steps,
)

PROG = "dptorch"
USAGE_ERROR = 2


class CommandError(Exception):
    """A failure that is not bad input (missing optional dependency, unwritable file)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors become one line instead of usage text plus a line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


# -- shared helpers ---------------------------------------------------------------------------


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def _round_up(value: float, digits: int = 4) -> float:
    """``value`` rounded up to ``digits`` significant digits (a printed sigma never adds privacy loss)."""
    if value <= 0 or not math.isfinite(value):
        return value
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return math.ceil(value * scale - 1e-9) / scale


def _json_number(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def _accountant_label(name: str) -> str:
    return "gdp approximation, not a bound" if name == "gdp" else name


def _accountant_list(values: Optional[List[str]]) -> List[str]:
    """Names from repeated and/or comma-separated ``--accountant`` options, in order, deduplicated."""
    names: List[str] = []
    for value in values or [DEFAULT_ACCOUNTANT]:
        for part in value.split(","):
            if part.strip():
                name = check_accountant_name(part, "--accountant")
                if name not in names:
                    names.append(name)
    if not names:
        raise ValueError(f"--accountant must name at least one of {', '.join(ACCOUNTANTS)}")
    return names


def _emit(payload: Dict[str, Any], lines: Sequence[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps(payload))
    else:
        for line in lines:
            print(line)


# -- dptorch epsilon ------------------------------------------------------------------------


def add_epsilon_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "epsilon",
        help="epsilon of N steps of DP-SGD",
        description="Epsilon spent by N steps of DP-SGD (Poisson-sampled Gaussian mechanism).",
    )
    parser.add_argument("--noise-multiplier", type=float, required=True, metavar="S", help="sigma")
    parser.add_argument("--sample-rate", type=float, required=True, metavar="Q", help="Poisson sample rate q")
    parser.add_argument("--steps", type=int, required=True, metavar="N", help="number of steps")
    parser.add_argument("--delta", type=float, required=True, metavar="D", help="target delta")
    parser.add_argument(
        "--accountant",
        action="append",
        metavar="NAME",
        help=f"one of {', '.join(ACCOUNTANTS)} (default {DEFAULT_ACCOUNTANT}); repeat or comma-separate for several",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="also draw epsilon against steps (0..N) to this file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_epsilon)


def run_epsilon(args: argparse.Namespace) -> int:
    sigma = check_noise_multiplier(args.noise_multiplier, "--noise-multiplier")
    q = check_sample_rate(args.sample_rate, "--sample-rate")
    steps = check_steps(args.steps, "--steps")
    delta = check_delta(args.delta, "--delta")
    names = _accountant_list(args.accountant)
    if args.plot:
        _check_plot_target(args.plot)

    epsilons: Dict[str, float] = {}
    for name in names:
        accountant = create_accountant(name)
        accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        epsilons[name] = accountant.get_epsilon(delta)
    if args.plot:
        curves = {
            name: epsilon_curve(name, noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta)
            for name in names
        }
        _plot_curves(args.plot, curves, sigma=sigma, q=q, delta=delta)

    lines = [
        f"epsilon = {_number(eps)} (delta = {delta:g}, {_accountant_label(name)}, {steps} steps, "
        f"sigma = {sigma:g}, q = {q:g})"
        for name, eps in epsilons.items()
    ]
    if args.plot:
        lines.append(f"plot written to {args.plot}")
    payload: Dict[str, Any] = {
        "epsilon": _json_number(epsilons[names[0]]),
        "accountant": names[0],
        "epsilons": {name: _json_number(eps) for name, eps in epsilons.items()},
        "delta": delta,
        "steps": steps,
        "noise_multiplier": sigma,
        "sample_rate": q,
    }
    if args.plot:
        payload["plot"] = args.plot
    _emit(payload, lines, args.json)
    return 0


def _check_plot_target(path: str) -> None:
    """Fail before the (slow) curves are computed if the plot could not be saved anyway."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CommandError(f"cannot write the plot to {path!r}: folder {folder!r} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CommandError("--plot needs matplotlib: pip install 'dptorch[plot]'") from None


def _plot_curves(path: str, curves: Dict[str, Any], *, sigma: float, q: float, delta: float) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CommandError("--plot needs matplotlib: pip install 'dptorch[plot]'") from None
    figure = Figure(figsize=(6.4, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, (steps, epsilons) in curves.items():
        axes.plot(steps, epsilons, label=_accountant_label(name), linestyle="--" if name == "gdp" else "-")
    axes.set_xlabel("steps")
    axes.set_ylabel(f"epsilon (delta = {delta:g})")
    axes.set_title(f"sigma = {sigma:g}, q = {q:g}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    try:
        figure.savefig(path, dpi=120)
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot write the plot to {path!r}: {error}") from None


# -- dptorch noise --------------------------------------------------------------------------


def add_noise_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "noise",
        help="smallest noise multiplier for an (epsilon, delta) target",
        description="Smallest noise multiplier whose epsilon does not exceed the target.",
    )
    parser.add_argument("--target-epsilon", type=float, required=True, metavar="E", help="target epsilon")
    parser.add_argument("--delta", type=float, required=True, metavar="D", help="target delta")
    parser.add_argument("--sample-rate", type=float, required=True, metavar="Q", help="Poisson sample rate q")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=float, metavar="E", help="epochs (steps = ceil(epochs / q))")
    length.add_argument("--steps", type=int, metavar="N", help="number of steps")
    parser.add_argument(
        "--accountant", default=DEFAULT_ACCOUNTANT, metavar="NAME", help=f"one of {', '.join(ACCOUNTANTS)}"
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.01, metavar="T", help="relative epsilon tolerance (default 0.01)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_noise)


def run_noise(args: argparse.Namespace) -> int:
    target = check_epsilon(args.target_epsilon, "--target-epsilon")
    delta = check_delta(args.delta, "--delta")
    q = check_sample_rate(args.sample_rate, "--sample-rate")
    if args.steps is not None:
        steps = check_steps(args.steps, "--steps")
    else:
        steps = steps_for_epochs(check_positive(args.epochs, "--epochs"), q)
    if steps == 0:
        raise ValueError("--steps must be >= 1, got 0")
    name = check_accountant_name(args.accountant, "--accountant")
    tolerance = check_positive(args.tolerance, "--tolerance")

    sigma = get_noise_multiplier(
        target_epsilon=target,
        target_delta=delta,
        sample_rate=q,
        steps=steps,
        accountant=name,
        epsilon_tolerance=tolerance,
    )
    shown = _round_up(sigma)
    accountant = create_accountant(name)
    accountant.step(noise_multiplier=shown, sample_rate=q, num_steps=steps)
    epsilon = accountant.get_epsilon(delta)
    lines = [
        f"noise multiplier = {shown:g} (target epsilon = {target:g}, delta = {delta:g}, "
        f"{_accountant_label(name)}, {steps} steps, q = {q:g}; epsilon = {_number(epsilon)})"
    ]
    payload = {
        "noise_multiplier": sigma,
        "noise_multiplier_rounded": shown,
        "epsilon": _json_number(epsilon),
        "target_epsilon": target,
        "delta": delta,
        "sample_rate": q,
        "steps": steps,
        "accountant": name,
        "epsilon_tolerance": tolerance,
    }
    if args.epochs is not None:
        payload["epochs"] = args.epochs
    _emit(payload, lines, args.json)
    return 0


# -- dptorch example ------------------------------------------------------------------------

#: Runnable examples: name -> (module, one-line description).
EXAMPLES = {
    "minilm": ("dptorch.examples.minilm", "DP fine-tuning of MiniLM on labelled tweets with DPTrainer (minutes)"),
    "digits": ("dptorch.examples.digits", "private CNN on scikit-learn's digits with PrivacyEngine (seconds)"),
}


def add_example_command(subparsers: Any) -> None:
    listing = "; ".join(f"{name}: {text}" for name, (_, text) in EXAMPLES.items())
    parser = subparsers.add_parser(
        "example",
        help="run an example end to end (offline)",
        description=f"Run an example end to end, offline. {listing}. Flags after NAME go to the example; "
        "'dptorch example NAME --help' lists them.",
    )
    parser.add_argument("name", choices=list(EXAMPLES), metavar="NAME", help=", ".join(EXAMPLES))
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="the example's own flags, e.g. --epsilon 3 --plots DIR")
    parser.set_defaults(handler=run_example)


def run_example(args: argparse.Namespace) -> int:
    import importlib

    try:
        module = importlib.import_module(EXAMPLES[args.name][0])
        module.main(args.flags, prog=f"{PROG} example {args.name}")
    except ImportError as error:  # a missing optional package (model, data, transformers, ...)
        raise CommandError(
            f"example {args.name!r} needs the optional packages: pip install 'dptorch[hf,plot,examples]' ({error})"
        ) from None
    except SystemExit as exit_request:  # the example's --help or a bad flag (argparse has printed it)
        return exit_request.code if isinstance(exit_request.code, int) else 2
    return 0


# -- entry point ----------------------------------------------------------------------------

#: Each function adds one subcommand; append yours to extend the CLI.
COMMANDS: List[Callable[[Any], None]] = [add_epsilon_command, add_noise_command, add_example_command]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Differentially private training tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI on ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as error:
        return _fail(str(error), USAGE_ERROR)
    except SystemExit as exit_request:  # --help
        return int(exit_request.code or 0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            code = args.handler(args)
        except ValueError as error:
            code = _fail(str(error), USAGE_ERROR)
        except CommandError as error:
            code = _fail(str(error), error.exit_code)
    shown = set()
    for warning in caught:
        message = str(warning.message)
        if message not in shown:
            shown.add(message)
            print(f"{PROG}: warning: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
