"""The ``dptorch`` command line.

    dptorch epsilon --noise-multiplier S --sample-rate Q (--epochs E | --steps N) --delta D [--accountant pld]
    dptorch noise --target-epsilon E --delta D --sample-rate Q (--epochs E | --steps N) [--plot FILE.png]
    dptorch --version
    dptorch audit [--canaries M] [--noise-multiplier S] [--steps N] [--delta D] [--plot FILE.png] [--json]

Adding a subcommand: write ``add_<name>_command(subparsers)`` that creates its parser with
``subparsers.add_parser(...)`` and sets ``handler=run_<name>`` through ``set_defaults``; the
handler takes the parsed arguments and returns the exit code. Append the function to
:data:`COMMANDS`. A ``ValueError`` from a handler is bad input: it is printed as one line
``dptorch: error: ...`` and the exit code is 2. :class:`CommandError` is for other failures.
Bad values are refused by the checks the Python API uses (``dptorch.accounting.validation``),
called with the option's name, so the messages are the API's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from dptorch import __version__  # the root package: __version__ and lazy public names only

PROG = "dptorch"
USAGE_ERROR = 2

#: The accountants' names as the help texts show them. The accountants themselves (and scipy,
#: dp_accounting) load only when a command computes, so that ``--help`` and ``--version`` start
#: at once; tests/test_cli_startup.py checks these names against ``dptorch.accounting.ACCOUNTANTS``.
ACCOUNTANTS = ("pld", "prv", "rdp", "gdp")
DEFAULT_ACCOUNTANT = "pld"


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
    from dptorch.accounting import check_accountant_name  # start-up time
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


def _add_length_options(parser: argparse.ArgumentParser) -> None:
    """``--epochs`` or ``--steps``, exactly one."""
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=float, metavar="E", help="epochs (steps = ceil(epochs / q))")
    length.add_argument("--steps", type=int, metavar="N", help="number of steps")


def _add_dataset_size_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset-size", type=int, metavar="N",
        help="privacy units (samples) in the data set: delta must be below 1/N, as make_private requires; "
        "without it delta must be below the sample rate (N >= 1/q)",
    )


def _steps(args: argparse.Namespace, q: float) -> int:
    """The steps of ``--steps``, or of ``--epochs`` at rate q (the calibration's rule)."""
    from dptorch.accounting import steps_for_epochs  # start-up time
    from dptorch.accounting.validation import check_positive, check_steps  # start-up time
    if args.steps is not None:
        return check_steps(args.steps, "--steps")
    return steps_for_epochs(check_positive(args.epochs, "--epochs"), q)


def _delta(args: argparse.Namespace, q: float) -> float:
    """``--delta`` checked as the engine checks it: in (0, 1) and below 1/N (N >= 1/q without ``--dataset-size``)."""
    from dptorch.accounting.validation import check_delta_for_units  # start-up time
    size = args.dataset_size
    if size is not None and size < 1:
        raise ValueError(f"--dataset-size must be a whole number >= 1, got {size}")
    return check_delta_for_units(args.delta, size, "--delta", sample_rate=q)


def _epsilon(name: str, sigma: float, q: float, steps: int, delta: float) -> float:
    """Epsilon of ``steps`` steps at (sigma, q): 0 without steps, infinite without noise (as the plan says)."""
    from dptorch.accounting import create_accountant  # start-up time
    if steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    accountant = create_accountant(name)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_epsilon(delta)


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
    parser.add_argument("--noise-multiplier", type=float, required=True, metavar="S",
                        help="sigma (0: no noise, epsilon is infinite)")
    parser.add_argument("--sample-rate", type=float, required=True, metavar="Q", help="Poisson sample rate q")
    _add_length_options(parser)
    parser.add_argument("--delta", type=float, required=True, metavar="D", help="target delta")
    _add_dataset_size_option(parser)
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
    from dptorch.accounting import epsilon_curve  # start-up time
    from dptorch.accounting.validation import check_non_negative, check_sample_rate  # start-up time
    sigma = check_non_negative(args.noise_multiplier, "--noise-multiplier")
    q = check_sample_rate(args.sample_rate, "--sample-rate")
    steps = _steps(args, q)
    delta = _delta(args, q)
    names = _accountant_list(args.accountant)
    if args.plot:
        if sigma == 0:
            raise ValueError("--plot has no curve to draw at --noise-multiplier 0: epsilon is infinite after one step")
        _check_plot_target(args.plot)

    epsilons = {name: _epsilon(name, sigma, q, steps, delta) for name in names}
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
    if args.epochs is not None:
        payload["epochs"] = args.epochs
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


#: Line of each accountant on ``epsilon --plot``: PLD and PRV nearly coincide, so PLD is a wide
#: solid line and PRV a thin dashed one with markers on top of it; each stays visible.
CURVE_STYLES: Dict[str, Dict[str, Any]] = {
    "pld": dict(linestyle="-", linewidth=3.0, alpha=0.6),
    "prv": dict(linestyle="--", linewidth=1.4, marker="o", markersize=3.5, markevery=4),
    "rdp": dict(linestyle="-.", linewidth=1.6),
    "gdp": dict(linestyle=":", linewidth=2.0),
}


def _new_figure() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CommandError("--plot needs matplotlib: pip install 'dptorch[plot]'") from None
    figure = Figure(figsize=(6.4, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def curves_figure(curves: Dict[str, Any], *, sigma: float, q: float, delta: float) -> Any:
    """The figure of ``epsilon --plot``: epsilon against steps, one line (style) per accountant."""
    figure = _new_figure()
    axes = figure.add_subplot()
    for name, (steps, epsilons) in curves.items():
        axes.plot(steps, epsilons, label=_accountant_label(name), **CURVE_STYLES.get(name, {}))
    axes.set_xlabel("steps")
    axes.set_ylabel(f"epsilon (delta = {delta:g})")
    axes.set_title(f"sigma = {sigma:g}, q = {q:g}")
    _decorate(axes)
    return figure


def _plot_curves(path: str, curves: Dict[str, Any], *, sigma: float, q: float, delta: float) -> None:
    _save_plot(curves_figure(curves, sigma=sigma, q=q, delta=delta), path)


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
    _add_length_options(parser)
    _add_dataset_size_option(parser)
    parser.add_argument(
        "--accountant", default=DEFAULT_ACCOUNTANT, metavar="NAME",
        help=f"one of {', '.join(name for name in ACCOUNTANTS if name != 'gdp')} (default {DEFAULT_ACCOUNTANT}); "
        "'gdp' is an approximation and cannot calibrate",
    )
    parser.add_argument(
        "--tolerance", type=float, default=1e-3, metavar="T",
        help="how far below the target the epsilon may land, as a fraction of it, in (0, 1) (default 0.001: "
        "the noise multiplier's epsilon is within 0.1%% below the target, never above)",
    )
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw the noise multiplier against epsilon (same q, steps, delta) to this file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_noise)


def run_noise(args: argparse.Namespace) -> int:
    from dptorch.accounting import check_accountant_name, get_noise_multiplier  # start-up time
    from dptorch.accounting.validation import check_epsilon, check_positive, check_sample_rate  # start-up time
    target = check_epsilon(args.target_epsilon, "--target-epsilon")
    q = check_sample_rate(args.sample_rate, "--sample-rate")
    delta = _delta(args, q)
    steps = _steps(args, q)
    if steps == 0:
        raise ValueError("--steps must be >= 1 to calibrate noise, got 0")
    name = check_accountant_name(args.accountant, "--accountant")
    tolerance = check_positive(args.tolerance, "--tolerance")
    if tolerance >= 1:
        raise ValueError(f"--tolerance must be in (0, 1), got {args.tolerance!r}")
    if args.plot:
        _check_plot_target(args.plot)

    sigma = get_noise_multiplier(
        target_epsilon=target,
        target_delta=delta,
        sample_rate=q,
        steps=steps,
        accountant=name,
        epsilon_tolerance=tolerance,
    )
    shown = _round_up(sigma)
    epsilon = _epsilon(name, shown, q, steps, delta)
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
    if args.plot:
        _plot_noise_curve(args.plot, name, shown=shown, epsilon=epsilon, target=target, q=q, steps=steps, delta=delta)
        lines.append(f"plot written to {args.plot}")
        payload["plot"] = args.plot
    _emit(payload, lines, args.json)
    return 0


def noise_figure(name: str, *, shown: float, epsilon: float, target: float, q: float, steps: int,
                 delta: float) -> Any:
    """The figure of ``noise --plot``: the noise multiplier against the epsilon it gives (sigma from
    half to four times the answer), epsilon on a log axis whose tick labels do not collide."""
    sigmas = [shown * 2 ** (k / 4) for k in range(-4, 9)]
    epsilons = [_epsilon(name, sigma, q, steps, delta) for sigma in sigmas]
    figure = _new_figure()
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter  # after _new_figure's check
    axes = figure.add_subplot()
    finite = [(e, s) for e, s in zip(epsilons, sigmas) if math.isfinite(e)]
    axes.plot([e for e, _ in finite], [s for _, s in finite], marker=".", label=_accountant_label(name))
    axes.plot([epsilon], [shown], marker="o", color="C3", linestyle="none",
              label=f"target {target:g}: sigma {shown:g} (epsilon {_number(epsilon)})")
    axes.set_xscale("log")
    # matplotlib labels the minor ticks of a log axis spanning under a decade or two: they collide.
    # Label 1, 2 and 5 of each decade (only 1 beyond three decades), nothing else.
    values = [e for e, _ in finite] + [epsilon]
    decades = math.log10(max(values) / min(values)) if min(values) > 0 else math.inf
    axes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 3 else (1.0,)))
    axes.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlabel(f"epsilon (delta = {delta:g})")
    axes.set_ylabel("noise multiplier sigma")
    axes.set_title(f"{steps} steps, q = {q:g}")
    _decorate(axes)
    return figure


def _plot_noise_curve(path: str, name: str, **numbers: Any) -> None:
    _save_plot(noise_figure(name, **numbers), path)


# -- dptorch example ------------------------------------------------------------------------

#: Runnable examples: name -> (module, one-line description).
EXAMPLES = {
    "minilm": ("dptorch.cli.examples.minilm", "DP fine-tuning of MiniLM on labelled tweets with DPTrainer (minutes)"),
    "digits": ("dptorch.cli.examples.digits", "private CNN on scikit-learn's digits with PrivacyEngine (seconds)"),
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


# -- dptorch audit --------------------------------------------------------------------------


def add_audit_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="audit DP-SGD empirically: epsilon lower bound from one run with gradient canaries",
        description="Train a linear model once with white-box Dirac gradient canaries through dptorch's DP-SGD and "
        "bound epsilon from below twice: Steinke, Nasr, Jagielski 2023, and the f-DP bound of Mahloujifar, Melis, "
        "Chaudhuri 2025. A lower bound above the claimed epsilon refutes the claim (exit code 1). Defaults: a "
        "claimed epsilon of about 2 at delta 1e-5.",
    )
    parser.add_argument("--canaries", type=int, default=500, metavar="M", help="number of canaries (default 500)")
    parser.add_argument("--noise-multiplier", action="append", metavar="S",
                        help="sigma (default 4); repeat or comma-separate to audit several runs")
    parser.add_argument("--steps", type=int, default=4, metavar="N", help="training steps (default 4)")
    parser.add_argument("--sample-rate", type=float, default=1.0, metavar="Q", help="Poisson sample rate (default 1)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, metavar="C", help="clipping bound (default 1)")
    parser.add_argument("--delta", type=float, default=1e-5, metavar="D", help="delta (default 1e-5)")
    parser.add_argument("--confidence", type=float, default=0.95, metavar="P", help="confidence (default 0.95)")
    parser.add_argument("--clipping", default="flat", metavar="MODE", help="flat, automatic or adaptive (default flat)")
    parser.add_argument("--grad-sample-mode", default="auto", metavar="MODE",
                        help="auto, hooks, bk, ghost, ... (default auto, as make_private)")
    parser.add_argument("--accountant", default=DEFAULT_ACCOUNTANT, metavar="NAME",
                        help=f"one of {', '.join(ACCOUNTANTS)} (default {DEFAULT_ACCOUNTANT})")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="seed of canaries, sampling and noise (default 0)")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw claimed against audited epsilon to this file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    from dptorch.accounting import check_accountant_name  # start-up time
    from dptorch.accounting.validation import (  # start-up time
        check_delta_for_units, check_noise_multiplier, check_positive, check_sample_rate, check_steps,
    )
    from dptorch.auditing import audit_dp_sgd, plot_audit  # here: start-up time (it loads the engine and torch)

    sigmas = [check_noise_multiplier(float(part), "--noise-multiplier")
              for value in (args.noise_multiplier or ["4"]) for part in value.split(",") if part.strip()]
    if not sigmas or any(s == 0 for s in sigmas):
        raise ValueError("--noise-multiplier must be > 0 (a run without noise claims no epsilon to audit)")
    steps = check_steps(args.steps, "--steps")
    q = check_sample_rate(args.sample_rate, "--sample-rate")
    delta = check_delta_for_units(args.delta, None, "--delta", sample_rate=q)
    check_positive(args.max_grad_norm, "--max-grad-norm")
    if not 0 < args.confidence < 1:
        raise ValueError(f"--confidence must be in (0, 1), got {args.confidence}")
    if args.canaries < 2:
        raise ValueError(f"--canaries must be >= 2, got {args.canaries}")
    if args.clipping not in ("flat", "automatic", "adaptive"):
        raise ValueError(f"--clipping must be flat, automatic or adaptive, got {args.clipping!r}")
    name = check_accountant_name(args.accountant, "--accountant")
    if args.plot:
        _check_plot_target(args.plot)
    results = [
        audit_dp_sgd(num_canaries=args.canaries, noise_multiplier=sigma, steps=steps, sample_rate=q,
                     max_grad_norm=args.max_grad_norm, delta=delta, confidence=args.confidence, clipping=args.clipping,
                     grad_sample_mode=args.grad_sample_mode, accountant=name, seed=args.seed)
        for sigma in sigmas
    ]
    if args.plot:
        plot_audit(results, args.plot)
    lines = []
    for sigma, result in zip(sigmas, results):
        verdict = "consistent with the claim" if result.consistent else "REFUTES the claimed epsilon"
        lines.append(
            f"audited epsilon >= {_number(result.epsilon_lower_bound)} (Steinke et al.: {result.num_correct} of "
            f"{result.num_guesses} guesses right), >= {_number(result.fdp_epsilon_lower_bound)} (f-DP: "
            f"{result.fdp_num_correct} of {result.fdp_num_guesses} guessed in right) at {result.confidence:.0%} "
            f"confidence, claimed epsilon = {_number(result.claimed_epsilon)} (delta = {delta:g}, sigma = {sigma:g}, "
            f"{steps} steps, q = {q:g}, {result.num_canaries} canaries): {verdict}"
        )
    if args.plot:
        lines.append(f"plot written to {args.plot}")
    payload: Dict[str, Any] = results[0].to_dict() if len(results) == 1 else {"runs": [r.to_dict() for r in results]}
    if args.plot:
        payload["plot"] = args.plot
    _emit(payload, lines, args.json)
    return 0 if all(r.consistent for r in results) else 1


# -- entry point ----------------------------------------------------------------------------

#: Each function adds one subcommand; append yours to extend the CLI.
COMMANDS: List[Callable[[Any], None]] = [add_epsilon_command, add_noise_command, add_example_command, add_audit_command]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Differentially private training tools.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
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


def _decorate(axes: Any) -> None:
    axes.grid(True, alpha=0.3)
    axes.legend()


def _save_plot(figure: Any, path: str) -> None:
    """Write the figure; an unwritable path is a command error."""
    try:
        figure.savefig(path, dpi=120)
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot write the plot to {path!r}: {error}") from None

