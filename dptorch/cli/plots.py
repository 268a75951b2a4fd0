"""Pictures of a private training run, for the examples and for your own loop.

Record each optimizer step of a run into a :class:`RunHistory` (training loss, epsilon spent,
fraction of clipped samples) and the test accuracy after each epoch; :func:`save_pictures`
draws them, the private run against its non-private twin, or one ``plot_*`` function draws one
picture. Nothing is trained here, and matplotlib (Agg backend, no display) is imported only
when a picture is drawn::

    history = RunHistory("private")
    for epoch in range(1, epochs + 1):
        for x, y in loader:
            ...  # the private step
            history.record(loss=loss.item(), epsilon=engine.get_epsilon(delta),
                           clipped_fraction=optimizer.last_clipped_fraction)
        history.record_test_accuracy(epoch, accuracy(model))
    save_pictures("pictures", history, delta=delta, target_epsilon=target)
"""

from __future__ import annotations

import math
import os
import textwrap
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

PRIVATE_COLOR = "#c2410c"
NON_PRIVATE_COLOR = "#1d4ed8"


@dataclass
class RunHistory:
    """Per-step records of one training run; step ``k`` (1-based) is at index ``k - 1``."""

    label: str
    loss: List[float] = field(default_factory=list)
    epsilon: List[float] = field(default_factory=list)
    clipped_fraction: List[float] = field(default_factory=list)
    test_accuracy: List[Tuple[float, float]] = field(default_factory=list)

    def record(self, *, loss: float, epsilon: Optional[float] = None, clipped_fraction: Optional[float] = None) -> None:
        """One optimizer step; values not known for this run (epsilon of a non-private run) stay out."""
        self.loss.append(float(loss))
        if epsilon is not None:
            self.epsilon.append(float(epsilon))
        if clipped_fraction is not None:
            self.clipped_fraction.append(float(clipped_fraction))

    def record_test_accuracy(self, epoch: float, accuracy: float) -> None:
        """The test accuracy after ``epoch`` epochs (0: before training)."""
        self.test_accuracy.append((float(epoch), float(accuracy)))

    @property
    def steps(self) -> int:
        return len(self.loss)


def save_pictures(
    folder: str, private: RunHistory, non_private: Optional[RunHistory] = None, *, delta: float,
    target_epsilon: Optional[float] = None,
) -> List[str]:
    """Write epsilon.png, loss.png, test_accuracy.png (when an accuracy was recorded) and
    clipped_fraction.png into ``folder``; return their paths."""
    non_private = non_private or RunHistory("non-private")
    pictures = {
        "epsilon.png": lambda path: plot_epsilon(private, path, delta=delta, target_epsilon=target_epsilon),
        "loss.png": lambda path: plot_loss(private, non_private, path),
        "test_accuracy.png": lambda path: plot_test_accuracy(private, non_private, path),
        "clipped_fraction.png": lambda path: plot_clipped_fraction(private, path),
    }
    if not (private.test_accuracy or non_private.test_accuracy):
        del pictures["test_accuracy.png"]
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, draw in pictures.items():
        paths.append(os.path.join(folder, name))
        draw(paths[-1])
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


def plot_test_accuracy(private: RunHistory, non_private: RunHistory, path: str) -> None:
    """Test accuracy after each epoch, private against non-private (when it ran): the gap at the end
    is what privacy cost."""
    figure, axes = _figure()
    for history, color in ((non_private, NON_PRIVATE_COLOR), (private, PRIVATE_COLOR)):
        if history.test_accuracy:
            epochs, accuracies = zip(*history.test_accuracy)
            axes.plot(epochs, accuracies, color=color, linewidth=2, marker="o", label=history.label)
            axes.annotate(f"{accuracies[-1]:.3f}", (epochs[-1], accuracies[-1]), textcoords="offset points",
                          xytext=(-6, 6), ha="right", va="bottom", color=color)
    axes.yaxis.set_major_formatter(_percent_formatter())
    _finish(axes, title="Test accuracy after each epoch", ylabel="test accuracy", xlabel="epoch")
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


def _finish(axes, *, title: str, ylabel: str, xlabel: str = "optimizer step") -> None:
    axes.set_title(title, fontsize=11)
    axes.set_xlabel(xlabel)
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


