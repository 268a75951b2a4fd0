"""DPLoss: a per-sample loss wrapper, Opacus' ``DPLossFastGradientClipping`` for dptorch.

``criterion = DPLoss(nn.CrossEntropyLoss(), hooks); loss = criterion(output, target); loss.backward()``
computes each sample's loss (the criterion's ``reduction`` is set to ``"none"`` for the call),
checks that there is one per sample, and reduces them as the controller's ``loss_reduction``
says. ``backward()`` is one ordinary backward pass: in every mode ("ghost" and "bk" included)
the controller forms the per-sample norms and the clipped sum from what it captured in that pass.
The wrapper is optional (any loss whose reduction matches the controller's works); it exists so
that Opacus code, and per-sample losses of criteria without a ``reduction`` attribute, carry over.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from dptorch.grad_sample.capture.hooks import GradSampleHooks
from dptorch.grad_sample.modes.names import LOSS_REDUCTIONS


class DPLoss:
    """Wrap ``criterion`` so that it returns one loss per sample, reduced like the controller's.

    ``criterion`` may have a ``reduction`` attribute (torch losses: set to ``"none"`` during the
    call) or none (HF-style loss functions, which must then return one loss per sample). The
    per-sample loss must have the batch's length: a scalar would silently clip the whole batch
    as one sample, so it is refused. ``loss_reduction`` defaults to the controller's; a different
    one is refused (the per-sample gradients would be off by the batch size).
    """

    def __init__(self, criterion: Callable[..., torch.Tensor], hooks: GradSampleHooks, loss_reduction: Optional[str] = None) -> None:
        if loss_reduction is not None and loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if loss_reduction is not None and loss_reduction != hooks.loss_reduction:
            raise ValueError(
                f"DPLoss(loss_reduction={loss_reduction!r}) contradicts the per-sample gradient controller's "
                f"loss_reduction={hooks.loss_reduction!r}: the controller rescales the captured gradients by its own "
                "reduction, so every sample's gradient would be off by the batch size and its clipping by as much. "
                f"Leave DPLoss's loss_reduction out (it follows the controller's), or pass loss_reduction="
                f"{loss_reduction!r} to make_private / GradSampleHooks as well"
            )
        self.criterion = criterion
        self.hooks = hooks
        self.loss_reduction = hooks.loss_reduction

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
    """The wrapped loss: reads like a scalar loss; ``backward()`` is one backward pass of it.

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
        self.value.backward()

    def item(self) -> float:
        return self.value.item()

    def detach(self) -> torch.Tensor:
        return self.value.detach()

    def __float__(self) -> float:
        return self.item()

    def __repr__(self) -> str:
        return f"DPLossValue({self.value.item():.6g})"
