"""The saved model card of a private Trainer: the privacy report (:mod:`dptorch.accounting.report`)
under an HF metadata header that says how the model was trained.

The Hub reads a card's YAML header: ``library_name`` (the library that loads the folder: ``peft``
for an adapter, else ``transformers``; one already there, PEFT's or transformers', is kept) and
``tags``, to which ``differential-privacy`` and ``dptorch`` are added, so that private models can
be found by tag. Every other key of the header is kept.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

from huggingface_hub.repocard import metadata_load, metadata_save

from dptorch.accounting.report import MODEL_CARD_HEADING, write_model_card

#: Tags a private Trainer's card carries.
PRIVATE_TAGS = ("differential-privacy", "dptorch")


def card_metadata(metadata: Mapping[str, Any], *, is_adapter: bool) -> dict:
    """``metadata`` with ``library_name`` set when missing and the private tags added once."""
    updated = dict(metadata)
    updated.setdefault("library_name", "peft" if is_adapter else "transformers")
    tags = updated.get("tags") or []
    tags = [tags] if isinstance(tags, str) else list(tags)
    updated["tags"] = tags + [tag for tag in PRIVATE_TAGS if tag not in tags]
    return updated


def audit_section(audit: Mapping[str, Any]) -> str:
    """The report's ``audit`` entry (a run with audit canaries) as a subsection of the privacy section."""
    verdict = ("consistent with the claim" if audit["consistent"]
               else "**above the claimed epsilon: the implementation leaks more than it claims**")
    return (
        "### Empirical privacy audit\n\n"
        f"One-run white-box audit with {audit['num_canaries']} {audit['canary_kind']} gradient canaries in this "
        f"training run ({audit['num_included']} included, each with probability 1/2; {audit['steps']} steps). "
        f"Audited lower bounds on epsilon at delta {audit['delta']:g}, {audit['confidence']:.0%} confidence: "
        f"{audit['steinke_epsilon']:.4g} (Steinke, Nasr and Jagielski 2023), {audit['fdp_epsilon']:.4g} (f-DP, "
        f"Mahloujifar, Melis and Chaudhuri 2025); claimed epsilon {audit['claimed_epsilon']:.4g}: {verdict}. "
        "A lower bound from one run, not a proof of privacy.\n"
    )


def tuning_section(tuning: Mapping[str, Any], run_epsilon: float) -> str:
    """The report's ``tuning`` entry (a hyperparameter search on the same data) as a subsection: what the epsilon
    above covers (one trial, or this run), and the release's epsilon with the selection included."""
    delta = tuning["delta"]
    if not tuning.get("selection_accounted"):
        what = (f"This model is one of {tuning.get('trials', 'several')} trials of a plain hyperparameter search on the "
                "same data. The epsilon above is this trial's alone" if tuning.get("role") == "trial" else
                "This run's hyperparameters were chosen by a plain hyperparameter search on the same data. The epsilon "
                "above is this run's alone")
        return ("### Hyperparameter selection\n\n"
                f"{what}: choosing among trials by their scores is **not accounted** (run the search with "
                "`expected_trials=` for the random-stopping protocol, whose epsilon includes the selection).\n")
    protocol = (f"a hyperparameter search on the same data by the random-stopping protocol (Papernot and Steinke "
                f"2022; {tuning['trials_distribution']} number of trials, mean {tuning['expected_trials']:g}), "
                f"each trial within ({tuning['per_trial_epsilon']:.4g}, {delta:g})-DP")
    if tuning.get("role") == "trial":
        return ("### Hyperparameter selection\n\n"
                f"This model is a trial of {protocol}. Releasing the best trial (by the search's objective) is "
                f"**({tuning['epsilon']:.4g}, {delta:g})-DP**, the selection included; the epsilon above is this trial's "
                "alone. Releasing several trials, or one chosen otherwise, is not covered by that figure.\n")
    total = tuning["epsilon"] + (math.inf if run_epsilon is None else run_epsilon)
    return ("### Hyperparameter selection\n\n"
            f"This run's hyperparameters were chosen by {protocol}, released at ({tuning['epsilon']:.4g}, {delta:g})-DP "
            f"with the selection included. Together with this run (basic composition): **epsilon <= {total:.4g} at "
            f"delta = {2 * delta:g}**.\n")


def _with_subsection(text: str, section: str) -> str:
    """``text`` with ``section`` added at the end of its privacy section."""
    start = text.find(MODEL_CARD_HEADING)
    end = text.find("\n## ", start + len(MODEL_CARD_HEADING))
    end = len(text) if end < 0 else end + 1
    body = text[:end].rstrip("\n") + "\n\n" + section
    return body + ("\n" + text[end:] if end < len(text) else "")


def write_private_model_card(folder: str, report: Mapping[str, Any]) -> str:
    """Write the privacy section into ``folder``'s README.md and its metadata header; return the path. A report with
    an ``audit`` entry (audit canaries) gets the audit as a subsection of the privacy section, one with a ``tuning``
    entry (a hyperparameter search) what its epsilon covers and the search's."""
    report = dict(report)
    audit, tuning = report.pop("audit", None), report.pop("tuning", None)
    path = write_model_card(folder, report)
    sections = ([audit_section(audit)] if audit is not None else []) + (
        [tuning_section(tuning, report["epsilon"])] if tuning is not None else [])
    if sections:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        for section in sections:
            text = _with_subsection(text, section)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    is_adapter = os.path.exists(os.path.join(folder, "adapter_config.json"))
    metadata_save(path, card_metadata(metadata_load(path) or {}, is_adapter=is_adapter))
    return path


__all__ = ["PRIVATE_TAGS", "audit_section", "card_metadata", "tuning_section", "write_private_model_card"]
