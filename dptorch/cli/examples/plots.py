"""What the examples record and how they show it: the final report (text) and pictures (PNG).

A :class:`RunHistory` collects one value per optimizer step (training loss, epsilon spent,
fraction of clipped samples). :func:`format_report` turns the numbers of a finished private
run and its non-private twin into a few lines; the ``plot_*`` functions turn histories into PNG
files. They are pure: nothing is trained here, and matplotlib (Agg backend, no display) is
imported only when a picture is drawn.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Sequence

PRIVATE_COLOR = "#c2410c"
NON_PRIVATE_COLOR = "#1d4ed8"
PICTURES = ("epsilon.png", "loss.png", "clipped_fraction.png")


@dataclass
class RunHistory:
    """Per-step records of one training run; step ``k`` (1-based) is at index ``k - 1``."""

    label: str
    loss: List[float] = field(default_factory=list)
    epsilon: List[float] = field(default_factory=list)
    clipped_fraction: List[float] = field(default_factory=list)

    def record(self, *, loss: float, epsilon: Optional[float] = None, clipped_fraction: Optional[float] = None) -> None:
        """One optimizer step; values not known for this run (epsilon of a non-private run) stay out."""
        self.loss.append(float(loss))
        if epsilon is not None:
            self.epsilon.append(float(epsilon))
        if clipped_fraction is not None:
            self.clipped_fraction.append(float(clipped_fraction))

    @property
    def steps(self) -> int:
        return len(self.loss)


# ---------------------------------------------------------------------------------- report


def format_report(report: Mapping[str, Any]) -> str:
    """The closing lines of an example: accuracies, the guarantee, and where the time went."""
    baseline = report.get("non_private_accuracy") is not None
    mode = f", per-sample gradients {report['grad_sample_mode']}" if report.get("grad_sample_mode") else ""
    lines = [
        f"accuracy: private {report['private_accuracy']:.3f}, "
        + (f"non-private {report['non_private_accuracy']:.3f}" if baseline else "non-private not run (--no-baseline)")
        + (f" (test set of {report['test_size']})" if report.get("test_size") else ""),
        f"privacy: epsilon {report['epsilon']:.2f} at delta {report['delta']:g} ({report['accountant']} accountant), "
        f"noise multiplier {report['noise_multiplier']:.3f}, {report['steps']} steps, "
        f"sample rate {report['sample_rate']:.4f}, max grad norm {_clip_bound(report):g}{mode}",
        f"wall time: {report['total_seconds']:.1f} s (private training {report['private_seconds']:.1f} s"
        + (f", non-private {report['non_private_seconds']:.1f} s)" if baseline else ")"),
    ]
    if report.get("pictures"):
        folder = os.path.dirname(report["pictures"][0]) or "."
        lines.append(f"pictures in {folder}/: " + ", ".join(os.path.basename(p) for p in report["pictures"]))
    return "\n".join(lines)


def _clip_bound(report: Mapping[str, Any]) -> float:
    return report.get("max_grad_norm", report.get("per_sample_max_grad_norm"))


def show_report(report: Mapping[str, Any], as_json: bool = False) -> None:
    """Print the report: the closing lines, or one JSON object (without the per-step histories)."""
    if as_json:
        print(json.dumps({key: value for key, value in report.items() if key != "histories"}))
    else:
        print("\n" + format_report(report))


# -------------------------------------------------------------------------------- pictures


def save_pictures(
    folder: str, private: RunHistory, non_private: RunHistory, *, delta: float, target_epsilon: Optional[float] = None
) -> List[str]:
    """Write epsilon.png, loss.png and clipped_fraction.png into ``folder``; return their paths."""
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, name) for name in PICTURES]
    plot_epsilon(private, paths[0], delta=delta, target_epsilon=target_epsilon)
    plot_loss(private, non_private, paths[1])
    plot_clipped_fraction(private, paths[2])
    return paths


def plot_epsilon(history: RunHistory, path: str, *, delta: float, target_epsilon: Optional[float] = None) -> None:
    """Epsilon spent after each step, with the target it was calibrated to."""
    figure, axes = _figure()
    steps = range(len(history.epsilon) + 1)
    axes.plot(steps, [0.0] + history.epsilon, color=PRIVATE_COLOR, linewidth=2, label="epsilon spent")
    if target_epsilon is not None:
        axes.axhline(target_epsilon, color="0.35", linestyle="--", linewidth=1, label=f"target {target_epsilon:g}")
    if history.epsilon:
        axes.annotate(
            f"{history.epsilon[-1]:.2f}", (len(history.epsilon), history.epsilon[-1]),
            textcoords="offset points", xytext=(-6, -6), ha="right", va="top", color=PRIVATE_COLOR,
        )
    axes.set_ylim(bottom=0)
    _finish(axes, title=f"Privacy spent (delta = {delta:g})", ylabel="epsilon")
    _save(figure, path)


#: Under the loss picture: why the private curve wanders (it is not divergence).
LOSS_NOTE = (
    "Private loss: the loss of each step's Poisson batch before its update, summed per sample and divided by "
    "the expected batch size (the batch size itself varies). The noise added at every step moves the weights "
    "at random too, so the curve wanders by tenths; it is not diverging. The test accuracy is the measure."
)


def plot_loss(private: RunHistory, non_private: RunHistory, path: str) -> None:
    """Training loss per step, private against non-private (when it ran): raw steps faint, moving
    average bold, and a note on why the private curve wanders."""
    figure, axes = _figure(height=4.6)
    for history, color in ((non_private, NON_PRIVATE_COLOR), (private, PRIVATE_COLOR)):
        if not history.steps:
            continue
        steps = list(range(1, history.steps + 1))
        axes.plot(steps, history.loss, color=color, alpha=0.25, linewidth=1)
        axes.plot(steps, moving_average(history.loss), color=color, linewidth=2, label=history.label)
    _finish(axes, title="Training loss (faint: each step, bold: moving average)", ylabel="loss")
    if private.steps:
        figure.text(0.01, 0.005, textwrap.fill(LOSS_NOTE, 110), fontsize=7, color="0.3", va="bottom", ha="left")
        figure.get_layout_engine().set(rect=(0, 0.1, 1, 0.9))
    _save(figure, path)


def plot_clipped_fraction(history: RunHistory, path: str) -> None:
    """Share of the samples whose gradient norm exceeded the clipping bound, per step."""
    figure, axes = _figure()
    steps = list(range(1, len(history.clipped_fraction) + 1))
    window = default_window(len(history.clipped_fraction))
    axes.plot(steps, history.clipped_fraction, color=PRIVATE_COLOR, alpha=0.3, linewidth=1, label="each step")
    axes.plot(steps, moving_average(history.clipped_fraction, window), color=PRIVATE_COLOR, linewidth=2,
              label=f"moving average ({window} steps)")
    axes.set_ylim(-0.02, 1.02)
    axes.yaxis.set_major_formatter(_percent_formatter())
    _finish(axes, title="Samples clipped at each step", ylabel="clipped samples")
    _save(figure, path)


def default_window(steps: int) -> int:
    """The moving average's window: a tenth of the run, at least 1 step."""
    return max(1, steps // 10)


def moving_average(values: Sequence[float], window: Optional[int] = None) -> List[float]:
    """Trailing mean over ``window`` steps (default: :func:`default_window`); NaN entries (a step
    without a loss: an empty Poisson batch) are left out of the means."""
    window = window or default_window(len(values))
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i + 1 - window):i + 1] if not math.isnan(v)]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def _figure(height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _finish(axes, *, title: str, ylabel: str) -> None:
    axes.set_title(title, fontsize=11)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.spines[["top", "right"]].set_visible(False)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(frameon=False)


def _percent_formatter():
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(xmax=1.0, decimals=0)


def _save(figure, path: str) -> None:
    figure.savefig(path, dpi=110)


