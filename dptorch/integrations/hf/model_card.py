"""The saved model card of a private Trainer: the privacy report (:mod:`dptorch.accounting.report`)
under an HF metadata header that says how the model was trained.

The Hub reads a card's YAML header: ``library_name`` (the library that loads the folder: ``peft``
for an adapter, else ``transformers``; one already there, PEFT's or transformers', is kept) and
``tags``, to which ``differential-privacy`` and ``dptorch`` are added, so that private models can
be found by tag. Every other key of the header is kept.
"""

from __future__ import annotations

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


def _with_audit(text: str, audit: Mapping[str, Any]) -> str:
    """``text`` with the audit subsection at the end of its privacy section (rewritten with it each time)."""
    start = text.find(MODEL_CARD_HEADING)
    end = text.find("\n## ", start + len(MODEL_CARD_HEADING))
    end = len(text) if end < 0 else end + 1
    body = text[:end].rstrip("\n") + "\n\n" + audit_section(audit)
    return body + ("\n" + text[end:] if end < len(text) else "")


def write_private_model_card(folder: str, report: Mapping[str, Any]) -> str:
    """Write the privacy section into ``folder``'s README.md and its metadata header; return the path. A report with
    an ``audit`` entry (audit canaries) gets the audit as a subsection of the privacy section."""
    report = dict(report)
    audit = report.pop("audit", None)
    path = write_model_card(folder, report)
    if audit is not None:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(_with_audit(text, audit))
    is_adapter = os.path.exists(os.path.join(folder, "adapter_config.json"))
    metadata_save(path, card_metadata(metadata_load(path) or {}, is_adapter=is_adapter))
    return path


__all__ = ["PRIVATE_TAGS", "audit_section", "card_metadata", "write_private_model_card"]
