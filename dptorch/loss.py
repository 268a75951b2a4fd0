"""DPLoss: the two-pass loss wrapper for ``grad_sample_mode="ghost"`` (Opacus' fast gradient clipping).

``loss = DPLoss(criterion, hooks)(output, target); loss.backward()`` runs the first backward pass
(per-sample norms from activations and output gradients), lets the DP optimizer pick the clip
factors, and takes the clipped gradient from a second pass of ``sum_i c_i loss_i``. The training
loop stays ``loss.backward(); optimizer.step()``. Book-keeping (``"bk"``) needs no wrapper.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from dptorch.grad_sample.hooks import LOSS_REDUCTIONS, GradSampleHooks


class DPLoss:
    """Wrap ``criterion`` so that its result backpropagates with ghost clipping.

    ``criterion`` may have a ``reduction`` attribute (torch losses: set to ``"none"`` during the
    call) or none (HF-style loss functions, which must then return one loss per sample). The
    per-sample loss must have the batch's length: a scalar would silently clip the whole batch
    as one sample, so it is refused.
    """

    def __init__(self, criterion: Callable[..., torch.Tensor], hooks: GradSampleHooks, loss_reduction: Optional[str] = None) -> None:
        self.criterion = criterion
        self.hooks = hooks
        self.loss_reduction = loss_reduction or hooks.loss_reduction
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {self.loss_reduction!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> "DPLossValue":
        per_sample = self._per_sample_losses(*args, **kwargs)
        rows = self.hooks.last_batch_size
        if per_sample.dim() == 0 or (rows is not None and per_sample.shape[0] != rows):
            got = "a scalar" if per_sample.dim() == 0 else f"shape {tuple(per_sample.shape)}"
            raise ValueError(
                f"DPLoss needs one loss per sample ({rows} for this batch) but the criterion returned {got}; "
                "give it a criterion with a `reduction` attribute or one that returns per-sample losses"
            )
        if per_sample.dim() > 1:
            rest = tuple(range(1, per_sample.dim()))
            per_sample = per_sample.sum(rest) if self.loss_reduction == "sum" else per_sample.mean(rest)
        return DPLossValue(per_sample, self.loss_reduction, self.hooks)

    def _per_sample_losses(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not hasattr(self.criterion, "reduction"):
            return self.criterion(*args, **kwargs)
        previous = self.criterion.reduction
        self.criterion.reduction = "none"
        try:
            return self.criterion(*args, **kwargs)
        finally:
            self.criterion.reduction = previous


class DPLossValue:
    """The wrapped loss: reads like a scalar loss; ``backward()`` runs both passes.

    Supports the arithmetic DPO-style objectives need: sums and differences of wrapped losses
    of the same batch, scaling by constants and negation. Every result keeps one loss per
    sample, and combining losses of different batch lengths is refused.
    """

    def __init__(self, per_sample: torch.Tensor, loss_reduction: str, hooks: GradSampleHooks) -> None:
        self.per_sample = per_sample
        self.loss_reduction = loss_reduction
        self.hooks = hooks
        self.value = per_sample.sum() if loss_reduction == "sum" else per_sample.mean()

    def _combine(self, other: "DPLossValue", op) -> "DPLossValue":
        if not isinstance(other, DPLossValue):
            return NotImplemented
        if other.per_sample.shape != self.per_sample.shape or other.loss_reduction != self.loss_reduction:
            raise ValueError(
                f"cannot combine wrapped losses of shapes {tuple(self.per_sample.shape)} and "
                f"{tuple(other.per_sample.shape)} (reductions {self.loss_reduction!r}, {other.loss_reduction!r}): "
                "both must come from the same batch"
            )
        return DPLossValue(op(self.per_sample, other.per_sample), self.loss_reduction, self.hooks)

    def _scale(self, factor: float) -> "DPLossValue":
        if not isinstance(factor, (int, float)):
            return NotImplemented
        return DPLossValue(self.per_sample * factor, self.loss_reduction, self.hooks)

    def __add__(self, other):
        return self._combine(other, torch.add)

    def __sub__(self, other):
        return self._combine(other, torch.sub)

    def __mul__(self, factor):
        return self._scale(factor)

    __rmul__ = __mul__

    def __truediv__(self, factor):
        return self._scale(1.0 / factor) if isinstance(factor, (int, float)) else NotImplemented

    def __neg__(self):
        return self._scale(-1.0)

    def backward(self) -> None:
        self.hooks.register_per_sample_loss(self.per_sample)
        try:
            self.value.backward(retain_graph=True)
        finally:
            self.hooks.register_per_sample_loss(None)

    def item(self) -> float:
        return self.value.item()

    def detach(self) -> torch.Tensor:
        return self.value.detach()

    def __float__(self) -> float:
        return self.item()

    def __repr__(self) -> str:
        return f"DPLossValue({self.value.item():.6g})"
