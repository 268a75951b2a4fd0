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

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

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


@dataclass(frozen=True)
class PackingRequest:
    """What a TRL config asked for: rows of ``max_length`` (``packing=True``) or one row (``padding_free``)."""

    max_length: Optional[int]


@contextlib.contextmanager
def packing_after_sampling(args: Any) -> Iterator[Optional[PackingRequest]]:
    """Around a TRL trainer's ``__init__``: its dataset is prepared unpacked (packing there would make packed rows
    the sampled units), and the request is handed to ``PackingCollator``; ``args`` is restored on exit.

    TRL's "wrapped" and "bfd_split" strategies split an example over rows or sequences: refused (a unit would be
    several units, each counted once by the accountant)."""
    packing, padding_free = bool(getattr(args, "packing", False)), bool(getattr(args, "padding_free", False))
    if not (packing or padding_free):
        yield None
        return
    strategy = getattr(args, "packing_strategy", "bfd")
    if packing and strategy != "bfd":
        raise ValueError(
            f"packing_strategy={strategy!r} splits an example over several rows or sequences, which would make one "
            "example several privacy units; use packing_strategy='bfd' (best-fit decreasing: examples stay whole)"
        )
    if packing and getattr(args, "max_length", None) is None:
        raise ValueError("packing=True needs max_length (the length of a packed row)")
    request = PackingRequest(int(args.max_length) if packing else None)
    args.packing, args.padding_free = False, False
    try:
        yield request
    finally:
        args.packing, args.padding_free = packing, padding_free


def check_packing(trainer: Any, privacy_args: Any, per_sample_loss_func: Any) -> None:
    """Refuse what packing after sampling does not cover (yet), before any step."""
    problems = []
    if privacy_args.privacy_unit_column is not None:
        problems.append("privacy_unit_column: a unit of several examples would span packed rows")
    if per_sample_loss_func is not None:
        problems.append("per_sample_loss_func: it takes one row per example; packed rows get dptorch.packed_loss")
    if trainer.args.world_size > 1:
        problems.append("several processes: packing is tested on one process only")
    if type(trainer._dp_recipe).__name__ not in ("OutputsRecipe", "SFTRecipe"):
        problems.append(f"{type(trainer).__name__}'s loss: packing is supported for SFT (and Trainer) losses only")
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    attention = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if attention != "sdpa":
        problems.append(f"attn_implementation={attention!r}: packed examples are kept apart through sdpa's mask only; "
                        "load the model with attn_implementation='sdpa'")
    if problems:
        raise ValueError("packing / padding_free cannot be trained privately with " + "; ".join(problems))


def pad_token_id(trainer: Any) -> int:
    """The pad token of the trainer's collator or tokenizer."""
    for source in (trainer.data_collator, getattr(trainer, "processing_class", None)):
        value = getattr(source, "pad_token_id", None)
        if value is not None:
            return int(value)
    raise ValueError("packing needs a pad token: give the tokenizer a pad_token")
