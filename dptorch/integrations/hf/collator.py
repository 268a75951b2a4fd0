"""DataCollatorForPrivateCausalLanguageModeling: pads, builds labels and per-row position ids.

Per-row ``position_ids`` of shape ``(batch, length)`` give position embeddings (GPT-2's ``wpe``)
one row per sample, so their per-sample gradients need no broadcast handling, and they count
from each row's first real token, so left-padded rows get the positions they get alone.
Labels come from the attention mask (padding is ``-100``), not from the pad token id, so a real
end-of-sequence token that doubles as the pad token is still learned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch

from dptorch.grad_sample.units.per_sample_losses import IGNORE_INDEX

Example = Union[Mapping[str, Any], Sequence[int]]


@dataclass
class DataCollatorForPrivateCausalLanguageModeling:
    """Collate tokenized examples for causal language modelling with per-sample losses.

    Each example is a mapping with ``input_ids`` (and optionally ``attention_mask`` and
    ``labels``, e.g. with the prompt set to -100) or a plain list of token ids. Rows are padded
    to the longest (rounded up to ``pad_to_multiple_of``) on the tokenizer's padding side, after
    truncation to ``max_length``. Returns ``input_ids``, ``attention_mask``, ``labels`` and
    ``position_ids``, all ``(batch, length)`` long tensors.
    """

    tokenizer: Any
    pad_to_multiple_of: Optional[int] = None
    max_length: Optional[int] = None

    def __post_init__(self) -> None:
        if getattr(self.tokenizer, "pad_token_id", None) is None:
            raise ValueError(
                "the tokenizer has no pad token; set one before collating, e.g. "
                "tokenizer.pad_token = tokenizer.eos_token"
            )

    def __call__(self, examples: List[Example]) -> Dict[str, torch.Tensor]:
        if len(examples) == 0:
            raise ValueError(
                "cannot collate an empty batch; under Poisson sampling the private trainer handles empty batches "
                "itself and does not call the collator"
            )
        rows = [self._row(example) for example in examples]
        length = max(len(ids) for ids, _, _ in rows)
        if self.pad_to_multiple_of:
            length = int(math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of)
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        pad_id = int(self.tokenizer.pad_token_id)
        input_ids, attention_mask, labels = [], [], []
        for ids, mask, row_labels in rows:
            padding = length - len(ids)
            input_ids.append(_pad(ids, padding, pad_id, left))
            attention_mask.append(_pad(mask, padding, 0, left))
            labels.append(_pad(row_labels, padding, IGNORE_INDEX, left))
        batch = {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "attention_mask": torch.tensor(attention_mask, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
        }
        batch["position_ids"] = (batch["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
        return batch

    def _row(self, example: Example):
        if isinstance(example, Mapping):
            if "input_ids" not in example:
                raise ValueError(f"each example needs 'input_ids'; got keys {sorted(example)}")
            ids = list(example["input_ids"])
            mask = example.get("attention_mask")
            mask = list(mask) if mask is not None else [1] * len(ids)
            labels = example.get("labels")
            labels = list(labels) if labels is not None else [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        else:
            ids = list(example)
            mask = [1] * len(ids)
            labels = list(ids)
        if not (len(ids) == len(mask) == len(labels)):
            raise ValueError(
                "input_ids, attention_mask and labels of an example differ in length "
                f"({len(ids)}, {len(mask)}, {len(labels)})"
            )
        if self.max_length is not None:
            ids, mask, labels = ids[: self.max_length], mask[: self.max_length], labels[: self.max_length]
        return [int(t) for t in ids], [int(m) for m in mask], [int(t) for t in labels]


def _pad(values: List[int], padding: int, fill: int, left: bool) -> List[int]:
    return [fill] * padding + values if left else values + [fill] * padding
