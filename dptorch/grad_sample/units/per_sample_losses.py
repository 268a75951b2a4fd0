"""Per-sample losses: one loss per row, each normalised by that row alone.

HuggingFace's token-level losses divide the summed token losses by the token count of the whole
(accumulated, all-rank) batch, ``num_items_in_batch``. A sample's gradient then depends on which
other samples were drawn, and the sensitivity argument of DP-SGD (each unit moves the sum by at
most C) no longer holds. Here every row's loss is the mean over its *own* target tokens; the
private trainer sums these and never passes ``num_items_in_batch`` on.

A per-sample loss function maps ``(model outputs, labels)`` to a tensor of shape ``(rows,)``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from dptorch.grad_sample.errors import PerSampleGradientError

PerSampleLoss = Callable[[Any, torch.Tensor], torch.Tensor]
IGNORE_INDEX = -100


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of a model output (a ModelOutput, a dict or a tuple)."""
    if isinstance(outputs, dict) or hasattr(outputs, "keys"):
        if "logits" not in outputs:
            raise ValueError(f"the model output has no 'logits' (keys: {list(outputs.keys())})")
        return outputs["logits"]
    return outputs[0]


def token_mean_per_sample(token_losses: torch.Tensor, mask: torch.Tensor, per_unit: str = "mean") -> torch.Tensor:
    """Each row's mean over its own valid tokens (0 for a row without any), or their sum (``per_unit="sum"``)."""
    mask = mask.to(token_losses.dtype)
    sums = (token_losses * mask).sum(dim=1)
    return sums if per_unit == "sum" else sums / mask.sum(dim=1).clamp(min=1.0)


def token_per_sample_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, shift: bool, label_smoothing: float = 0.0, per_unit: str = "mean"
) -> torch.Tensor:
    """Cross-entropy averaged (or, ``per_unit="sum"``, summed) over each row's target tokens: causal LM
    (``shift=True``), MLM or token classification (``shift=False``). Labels of ``-100`` are ignored."""
    if shift:
        logits, labels = logits[:, :-1, :], labels[:, 1:]
    labels = labels.to(logits.device)
    token_losses = F.cross_entropy(
        logits.float().flatten(0, 1),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(labels.shape)
    return token_mean_per_sample(token_losses, labels != IGNORE_INDEX, per_unit)


def causal_lm_per_sample_loss(outputs: Any, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy, averaged over each row's own target tokens."""
    return token_per_sample_loss(logits_of(outputs), labels, shift=True, label_smoothing=label_smoothing)


def sequence_per_sample_loss(
    logits: torch.Tensor, labels: torch.Tensor, problem_type: Optional[str] = None, label_smoothing: float = 0.0
) -> torch.Tensor:
    """One loss per row for sequence classification or regression, as HF chooses them."""
    labels = labels.to(logits.device)
    if problem_type is None:
        if logits.shape[-1] == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if problem_type == "regression":
        return (logits.float().view(labels.shape[0], -1) - labels.float().view(labels.shape[0], -1)).pow(2).mean(dim=1)
    if problem_type == "multi_label_classification":
        losses = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
        return losses.view(labels.shape[0], -1).mean(dim=1)
    return F.cross_entropy(logits.float(), labels.view(-1), reduction="none", label_smoothing=label_smoothing)


def default_per_sample_loss(
    causal: bool, problem_type: Optional[str] = None, label_smoothing: float = 0.0, per_unit: str = "mean"
) -> PerSampleLoss:
    """The per-sample loss for a model: token-level for (B, T, V) logits (shifted when ``causal``; each row's
    token mean, or sum with ``per_unit="sum"``), sequence-level for (B, C) logits."""

    def per_sample_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = logits_of(outputs)
        if logits.dim() == 3 and labels.dim() == 2:
            return token_per_sample_loss(logits, labels, shift=causal, label_smoothing=label_smoothing, per_unit=per_unit)
        if logits.dim() == 2:
            return sequence_per_sample_loss(logits, labels, problem_type, label_smoothing)
        raise ValueError(
            f"no default per-sample loss for logits of shape {tuple(logits.shape)} and labels of shape "
            f"{tuple(labels.shape)}; pass per_sample_loss_func=fn(outputs, labels) -> one loss per row"
        )

    return per_sample_loss


def check_label_padding(collator: Any) -> None:
    """Refuse a collator that pads labels with a token instead of ``-100``: each row's loss would then average over
    padding up to the batch's longest row, a length that depends on which other samples were drawn."""
    pad = getattr(collator, "label_pad_token_id", IGNORE_INDEX)
    if pad is not None and pad != IGNORE_INDEX:
        raise ValueError(
            f"the data collator pads labels with {pad} (label_pad_token_id), so each sample's loss would count "
            "padding up to the longest sample drawn with it, and its gradient would depend on the other samples; "
            f"pad labels with {IGNORE_INDEX} (the collator's default)"
        )


def check_per_sample_losses(losses: Any, rows: int) -> torch.Tensor:
    """``losses`` if it has one entry per row; else the error that explains the contract."""
    if not isinstance(losses, torch.Tensor) or losses.shape != (rows,):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise PerSampleGradientError(
            f"the per-sample loss must return one loss per row, shape ({rows},); got {shape}. A batch-level "
            "reduction (a mean over the batch or over its tokens) couples the samples' gradients; reduce within "
            "each row only (e.g. the mean over that row's tokens)"
        )
    return losses


def with_loss(outputs: Any, loss: torch.Tensor) -> Any:
    """``outputs`` of a model called without labels, with ``loss`` as its loss: a ModelOutput or dict rebuilt
    with ``loss`` first (its place when the model computes it), a tuple with ``loss`` prepended."""
    if isinstance(outputs, tuple):
        return (loss, *outputs)
    fields = {key: value for key, value in outputs.items() if key != "loss"}
    return type(outputs)(loss=loss, **fields)
