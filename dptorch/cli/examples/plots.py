"""The closing report of the examples: the numbers of a finished private run and its non-private
twin as a few lines, or one JSON object. Their pictures come from :mod:`dptorch.cli.plots`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

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
    if report.get("compiled"):
        compiled = report["compiled"]
        lines.append(f"compiled private step ({compiled['backend']}): {compiled['traces']} "
                     f"trace{'s' if compiled['traces'] != 1 else ''} (each a proof and a compilation)")
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
