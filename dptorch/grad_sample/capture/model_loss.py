"""The model's own loss, per sample: ``make_private(..., model_loss="mean")``.

A HuggingFace model computes ``outputs.loss`` through ``self.loss_function``: a token mean over the whole
batch, whose divisor (the batch's target tokens) couples every sample's gradient to the others', and which
the batch tracker refuses at ``backward()``. With this switch, a training forward that gets ``labels`` runs
without them (and without ``num_items_in_batch``), and ``outputs.loss`` becomes the per-sample form of the
same loss family (``units/per_sample_losses.py``, as the private Trainer computes it): each unit's mean over
its own target tokens (``"mean"``) or their sum (``"sum"``), reduced over the rows as the controller's
``loss_reduction`` says; the optimizer then divides the noised sum by the plan's constant divisor.

Two hooks on the model, kept here and removed by the controller's ``cleanup()``; nothing is set on the model.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn

from dptorch.grad_sample.capture.settings import Settings
from dptorch.grad_sample.units.per_sample_losses import check_per_sample_losses, default_per_sample_loss, with_loss

PER_UNIT = ("mean", "sum")

#: transformers' loss families (``LOSS_MAPPING`` keys) whose per-sample form is known: whether labels are shifted.
CAUSAL_BY_FAMILY = {"ForCausalLM": True, "ForMaskedLM": False, "ForTokenClassification": False,
                    "ForSequenceClassification": False}

_ONE_LINE_FIX = ("compute one loss per sample from the logits instead, e.g. "
                 "`loss = dptorch.grad_sample.units.per_sample_losses.token_per_sample_loss(outputs.logits, labels, "
                 "shift=True).mean()` (shift=False for masked LM or tagging)")


def loss_family(model: nn.Module) -> str:
    """The ``LOSS_MAPPING`` family whose function is ``model.loss_function``; refused when there is none known."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING  # optional dependency: only HF models have a loss_function
    except ImportError:
        LOSS_MAPPING = {}
    function = getattr(model, "loss_function", None) if hasattr(type(model), "loss_function") else None
    family = next((name for name in CAUSAL_BY_FAMILY if function is not None and LOSS_MAPPING.get(name) is function),
                  None)
    if family is None:
        what = (f"its loss_function is {getattr(function, '__name__', function)!r}" if function is not None
                else "it computes its loss without transformers' self.loss_function")
        raise ValueError(
            f"model_loss= makes a HuggingFace model's own loss per-sample, but {type(model).__name__} is not one it "
            f"knows ({what}; known: transformers' {', '.join(CAUSAL_BY_FAMILY)} losses). Leave model_loss out and "
            f"{_ONE_LINE_FIX}"
        )
    return family


class ModelLoss:
    """The hooks that withhold ``labels`` from a training forward of ``model`` and put the per-sample loss in
    its outputs; ``remove()`` takes them off."""

    def __init__(self, model: nn.Module, settings: Settings, per_unit: str) -> None:
        if per_unit not in PER_UNIT:
            raise ValueError(f"model_loss must be one of {PER_UNIT} (each unit's token mean or sum), got {per_unit!r}")
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            raise ValueError("model_loss= does not apply to encoder-decoder models: they build their decoder inputs "
                             f"from the labels, which it withholds. Leave model_loss out and {_ONE_LINE_FIX}")
        causal = CAUSAL_BY_FAMILY[loss_family(model)]
        self._per_sample = default_per_sample_loss(causal, getattr(getattr(model, "config", None), "problem_type", None),
                                                   per_unit=per_unit)
        self._settings = settings
        parameters = list(inspect.signature(model.forward).parameters)
        self._labels_at = parameters.index("labels") if "labels" in parameters else None
        self._labels: Optional[torch.Tensor] = None
        self._handles = [model.register_forward_pre_hook(self._withhold_labels, with_kwargs=True),
                         model.register_forward_hook(self._put_loss, with_kwargs=True)]

    def _withhold_labels(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        self._labels = None
        if not (module.training and torch.is_grad_enabled()):
            return None  # evaluation: the model's own loss, as it computes it
        labels = kwargs.pop("labels", None)
        if labels is None and self._labels_at is not None and len(args) > self._labels_at:
            labels, args = args[self._labels_at], (*args[: self._labels_at], None, *args[self._labels_at + 1 :])
        if labels is None:
            return None
        kwargs.pop("num_items_in_batch", None)  # the batch's token count couples the samples' losses
        self._labels = labels
        return args, kwargs

    def _put_loss(self, module: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> Any:
        labels, self._labels = self._labels, None
        if labels is None:
            return None
        losses = check_per_sample_losses(self._per_sample(outputs, labels), labels.shape[0])
        return with_loss(outputs, losses.mean() if self._settings.loss_reduction == "mean" else losses.sum())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._labels = None
