"""The loss of a packed forward: every example's own loss, summed over the examples.

With several examples packed in one row (token privacy units), the shifted next-token loss of a
row would predict the first token of one example from the last of the one before, and
HuggingFace's losses divide by the token count of the whole batch: either couples the examples'
gradients. ``packed_loss`` keeps only the predictions inside each unit, reduces them within the
unit (mean over its own targets, or sum), and sums the units (``loss_reduction="sum"``) or
averages them over the units drawn (``"mean"``). The controller accepts no other loss for a
packed forward (``tracking/loss.py``).
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.units.token_units import TokenUnits
from dptorch.grad_sample.tracking.loss import units_total

IGNORE_INDEX = -100
PER_UNIT = ("mean", "sum")


def unit_token_targets(units: TokenUnits, labels: torch.Tensor, shift: bool, ignore_index: int = IGNORE_INDEX
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(targets, unit, keep)`` per prediction position ``(B, T')``: the label predicted there, the unit
    (0..U-1) it belongs to, and whether it counts: inside one unit (with ``shift``, position ``t`` predicts
    ``t + 1`` only when both are in the same unit) and not ``ignore_index``."""
    ids = units.ids.to(labels.device)
    index = units.index.to(labels.device).view_as(ids)
    if shift:
        targets, unit = labels[:, 1:], index[:, :-1]
        keep = (ids[:, :-1] == ids[:, 1:]) & (ids[:, :-1] >= 0)
    else:
        targets, unit, keep = labels, index, ids >= 0
    return targets, unit, keep & (targets != ignore_index)


def per_unit_losses(token_losses: torch.Tensor, unit: torch.Tensor, keep: torch.Tensor, num_units: int, per_unit: str
                    ) -> torch.Tensor:
    """``(U,)``: each unit's kept token losses, summed or averaged over its own kept tokens."""
    weights = keep.to(token_losses.dtype)
    flat_unit = torch.where(keep, unit, torch.zeros_like(unit)).flatten()
    sums = token_losses.new_zeros(num_units).index_add(0, flat_unit, (token_losses * weights).flatten())
    if per_unit == "sum":
        return sums
    counts = weights.new_zeros(num_units).index_add(0, flat_unit, weights.flatten())
    return sums / counts.clamp(min=1.0)


def packed_loss(logits: torch.Tensor, labels: torch.Tensor, hooks: Any, *, shift: bool = True, per_unit: str = "mean",
                label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy of a packed forward's ``logits`` ``(B, T, V)`` against ``labels`` ``(B, T)``, per token unit.

    ``shift=True``: next-token prediction (causal LM); False: each position's own label (MLM, tagging).
    ``per_unit``: "mean" over the unit's own target tokens, or "sum". The units are summed, or averaged
    over the units when the controller's ``loss_reduction`` is "mean". ``logits`` must be the output the
    packed forward returned, unchanged.
    """
    if per_unit not in PER_UNIT:
        raise ValueError(f"per_unit must be one of {PER_UNIT}, got {per_unit!r}")
    units = hooks.separable_units(logits)
    if units is None:
        raise PerSampleGradientError(
            "packed_loss needs the logits a packed forward returned, as returned (set_privacy_units with (batch, "
            "tokens) ids, then the model's forward): these are not, or that forward's tokens did not keep its examples "
            "apart"
        )
    if logits.dim() != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"packed_loss needs logits (batch, tokens, classes) and labels (batch, tokens); got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    tracker = hooks._loss_tracker
    paused = tracker is not None and tracker.paused
    if tracker is not None:
        tracker.paused = True  # our own operations: the result is tagged below
    try:
        labels = labels.to(logits.device)
        targets, unit, keep = unit_token_targets(units, labels, shift, ignore_index)
        scores = logits[:, :-1] if shift else logits
        token_losses = F.cross_entropy(
            scores.float().flatten(0, 1), torch.where(keep, targets, torch.zeros_like(targets)).flatten(),
            reduction="none", label_smoothing=label_smoothing,
        ).view(targets.shape)
        losses = per_unit_losses(token_losses, unit, keep, units.num_units, per_unit)
        kind = "mean" if hooks.loss_reduction == "mean" else "sum"
        loss = losses.sum() / max(units.num_units, 1) if kind == "mean" else losses.sum()
    finally:
        if tracker is not None:
            tracker.paused = paused
    if tracker is not None:
        tracker.put(loss, units_total(tracker, kind))
    return loss
