"""Packing after sampling: the drawn examples of a micro-batch share rows, each one its own privacy unit.

Poisson sampling draws examples (the accountant's units); this collator then packs them into
rows, so q, N and the accounting are those of unpacked training. ``max_length=None`` puts the whole
micro-batch in one row (padding-free); otherwise examples go into rows of ``max_length`` tokens by
best-fit decreasing (TRL's "bfd" strategy), and an example longer than a row is truncated to it (it is
never split: a unit stays in one row). Each row's ``position_ids`` restart at 0 for every example and
the batch carries one unit id per token (``UNIT_IDS_KEY``; -1 for padding), so the controller
follows the tokens and ``dptorch.packed_loss`` gives each example its own loss.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from dptorch.integrations.hf.sampling import UNIT_IDS_KEY

IGNORE_INDEX = -100


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``: longest first, each into the fullest
    bin it fits (a new bin when none does)."""
    if capacity < 1:
        raise ValueError(f"a packed row must hold at least one token, got max_length={capacity}")
    bins: List[List[int]] = []
    room: List[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        size = min(int(lengths[i]), capacity)
        fits = [b for b in range(len(bins)) if room[b] >= size]
        if fits:
            best = min(fits, key=lambda b: room[b])
            bins[best].append(i)
            room[best] -= size
        else:
            bins.append([i])
            room.append(capacity - size)
    return bins


class PackingCollator:
    """Collate drawn examples (dicts with ``input_ids`` and optionally ``labels``) into packed rows.

    Returns ``input_ids``, ``labels`` (the examples' own, -100 on padding), ``position_ids`` and
    ``UNIT_IDS_KEY`` ``(rows, tokens)``; no ``attention_mask`` (transformers builds the block-diagonal
    mask from the position ids).
    """

    def __init__(self, pad_token_id: int, max_length: Optional[int] = None) -> None:
        self.pad_token_id = int(pad_token_id)
        self.max_length = max_length

    def __call__(self, examples: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        ids = [_tokens(e["input_ids"])[: self.max_length] for e in examples]
        labels = [_tokens(e["labels"])[: self.max_length] if e.get("labels") is not None else t.clone()
                  for e, t in zip(examples, ids)]
        if any(len(t) != len(lab) for t, lab in zip(ids, labels)):
            raise ValueError("each example's labels must have one entry per input id")
        lengths = [len(t) for t in ids]
        rows = [list(range(len(ids)))] if self.max_length is None else best_fit_decreasing(lengths, self.max_length)
        width = max((sum(lengths[i] for i in row) for row in rows), default=0)
        batch = {
            "input_ids": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
            "position_ids": torch.zeros((len(rows), width), dtype=torch.long),
            UNIT_IDS_KEY: torch.full((len(rows), width), -1, dtype=torch.long),
        }
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                span = slice(start, start + lengths[i])
                batch["input_ids"][r, span] = ids[i]
                batch["labels"][r, span] = labels[i]
                batch["position_ids"][r, span] = torch.arange(lengths[i])
                batch[UNIT_IDS_KEY][r, span] = i
                start += lengths[i]
            batch["position_ids"][r, start:] = torch.arange(width - start)  # padding: a span of its own
        return batch


def _tokens(values: Any) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long).flatten()
