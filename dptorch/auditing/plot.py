"""The audit's picture: claimed epsilon against the audited lower bound (matplotlib, ``dptorch[plot]``)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from dptorch.auditing.canaries import AuditResult
from dptorch.auditing.run import RunAudit


def plot_audit(results: Sequence[AuditResult], path: str, *, labels: Optional[Sequence[str]] = None) -> None:
    """Draw each result as a point (claimed epsilon, audited lower bound) with the line where they are equal.

    Points above the line refute the claim at the audit's confidence; a correct run lies below it.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = list(results)
    if not results:
        raise ValueError("plot_audit needs at least one AuditResult")
    labels = list(labels) if labels is not None else [
        f"sigma={r.settings.get('noise_multiplier', '?'):g}" if isinstance(r.settings.get("noise_multiplier"), (int, float))
        else f"run {i + 1}" for i, r in enumerate(results)
    ]
    finite = [v for r in results for v in (r.claimed_epsilon, r.epsilon_lower_bound) if math.isfinite(v)]
    top = max(finite + [1.0]) * 1.25
    figure = Figure(figsize=(5.6, 4.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot([0, top], [0, top], color="0.4", linestyle="--", linewidth=1, label="audited = claimed")
    axes.fill_between([0, top], [0, top], [top, top], color="tab:red", alpha=0.08, label="claim refuted")
    for result, label in zip(results, labels):
        bound = min(result.epsilon_lower_bound, top)
        color = "tab:blue" if result.consistent else "tab:red"
        claimed = min(result.claimed_epsilon, top)
        axes.scatter([claimed], [bound], color=color, zorder=3)
        right = claimed > 0.6 * top  # keep the label inside the axes
        axes.annotate(f"{label}: {result.num_correct}/{result.num_guesses} right", (claimed, bound),
                      textcoords="offset points", xytext=(-6 if right else 6, 6), ha="right" if right else "left",
                      fontsize=8)
    first = results[0]
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    axes.set_xlabel(f"claimed epsilon (delta = {first.delta:g})")
    axes.set_ylabel(f"audited epsilon lower bound ({first.confidence:.0%} confidence)")
    axes.set_title(f"one-run audit, {first.num_canaries} gradient canaries")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)
    figure.savefig(path, dpi=120)


def plot_audit_history(history: Sequence[RunAudit], path: str, *, title: Optional[str] = None) -> None:
    """Claimed epsilon and both audited lower bounds against the step, over one run's audits (``audit_run`` taken
    at several steps). A bound above the claimed line refutes the claim at the audit's confidence."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    history = sorted(history, key=lambda audit: audit.step)
    if not history:
        raise ValueError("plot_audit_history needs at least one RunAudit")
    steps = [audit.step for audit in history]
    figure = Figure(figsize=(6.0, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(steps, [a.claimed_epsilon for a in history], color="0.2", label="claimed epsilon (accountant)")
    axes.plot(steps, [a.fdp_epsilon for a in history], color="tab:red", marker="o", markersize=3,
              label="audited, f-DP (Mahloujifar et al.)")
    axes.plot(steps, [a.steinke_epsilon for a in history], color="tab:blue", marker="s", markersize=3,
              label="audited, Steinke et al.")
    first = history[-1]
    axes.set_xlabel("step")
    axes.set_ylabel(f"epsilon (delta = {first.delta:g}; bounds at {first.confidence:.0%} confidence)")
    axes.set_title(title or f"one-run audit of the training run, {first.num_canaries} gradient canaries")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)
    figure.savefig(path, dpi=120)


__all__ = ["plot_audit", "plot_audit_history"]
