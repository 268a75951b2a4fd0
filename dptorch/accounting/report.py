"""The privacy report of a run, one vocabulary for ``PrivacyEngine`` and the private Trainer.

:func:`privacy_report` adds to the privacy plan's numbers (:meth:`dptorch.plan.PrivacyPlan.report`:
epsilon, delta, accountant, noise multiplier, clipping bound ``max_grad_norm``, sample rate, steps,
...) what a reader of a model card also needs: the privacy unit and how many there are, how the
per-sample gradients were computed and the dptorch version. :func:`model_card_section` renders it
as Markdown for a model card (``README.md``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional

from dptorch import __version__  # the root package: __version__ and lazy public names only

#: Heading of the section the private Trainer writes into a model card.
MODEL_CARD_HEADING = "## Differential privacy"


def privacy_report(plan: Any, delta: float, *, grad_sample_mode: Optional[str], privacy_unit: str) -> Dict[str, Any]:
    """``plan.report(delta)`` plus ``privacy_unit``, ``num_units``, ``grad_sample_mode`` and ``dptorch_version``."""
    report = plan.report(delta)
    report.update(privacy_unit=privacy_unit, num_units=plan.num_units, grad_sample_mode=grad_sample_mode,
                  dptorch_version=__version__)
    return report


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def model_card_section(report: Mapping[str, Any]) -> str:
    """The report as a Markdown section: one sentence with the guarantee, then a table of every entry."""
    epsilon = report.get("epsilon")
    shown = "infinite (not private)" if epsilon is None or not math.isfinite(epsilon) else f"{epsilon:.4g}"
    unit = report.get("privacy_unit", "row")
    units = f" of {report['num_units']}" if report.get("num_units") else ""
    lines = [
        MODEL_CARD_HEADING,
        "",
        f"Trained with DP-SGD (dptorch {report.get('dptorch_version', '?')}): "
        f"({shown}, {report.get('delta'):g})-differential privacy for each privacy unit ({unit}{units}), "
        f"accounted with the {report.get('accountant')!r} accountant over {report.get('steps')} steps.",
        "",
        "| entry | value |",
        "| --- | --- |",
    ]
    for key, value in report.items():
        if isinstance(value, Mapping):
            value = ", ".join(f"{k}={_number(v)}" for k, v in value.items())
        lines.append(f"| {key} | {_number(value)} |")
    return "\n".join(lines) + "\n"


def add_to_model_card(text: str, report: Mapping[str, Any]) -> str:
    """``text`` (a model card, possibly empty) with its privacy section replaced by, or followed by, the report's."""
    section = model_card_section(report)
    start = text.find(MODEL_CARD_HEADING)
    if start < 0:
        return (text.rstrip("\n") + "\n\n" if text.strip() else "") + section
    end = text.find("\n## ", start + len(MODEL_CARD_HEADING))
    rest = text[end + 1:] if end >= 0 else ""
    return text[:start] + section + ("\n" + rest if rest else "")


def write_model_card(folder: str, report: Mapping[str, Any], name: str = "README.md") -> str:
    """Add (or refresh) the privacy section of ``folder``'s model card, creating the card if there is
    none; returns its path. The card's other content (PEFT's, transformers') is kept."""
    import os

    path = os.path.join(folder, name)
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(add_to_model_card(text, report))
    return path
