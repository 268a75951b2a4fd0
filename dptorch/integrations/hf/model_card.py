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

from dptorch.accounting.report import write_model_card

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


def write_private_model_card(folder: str, report: Mapping[str, Any]) -> str:
    """Write the privacy section into ``folder``'s README.md and its metadata header; return the path."""
    path = write_model_card(folder, report)
    is_adapter = os.path.exists(os.path.join(folder, "adapter_config.json"))
    metadata_save(path, card_metadata(metadata_load(path) or {}, is_adapter=is_adapter))
    return path


__all__ = ["PRIVATE_TAGS", "card_metadata", "write_private_model_card"]
