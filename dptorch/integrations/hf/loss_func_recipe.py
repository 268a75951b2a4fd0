"""``Trainer(compute_loss_func=fn)`` in the private Trainer.

HF calls ``fn(outputs, labels, num_items_in_batch=...)``, where ``num_items_in_batch`` is the token
count of the whole logical batch: a loss divided by it weighs each sample by how many tokens the
*other* samples have, which couples them (removing one sample would change every other sample's
gradient, past what clipping bounds). The private Trainer calls ``fn`` with
``num_items_in_batch=None`` on the model's outputs (the model called without labels, as for
``per_sample_loss_func``); what ``fn`` returns is then checked by the per-sample controller at
``backward()`` like any loss, before any gradient forms: a sum of terms each from one sample
(normalised within its sample, or by a constant) trains; a mean over the batch, or anything that
mixes samples, is refused. The function decides by what it computes, not by whether it takes the
argument.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import Trainer

from dptorch.integrations.hf.loss_recipes import LossRecipe, OutputsRecipe


class ComputeLossFuncRecipe(OutputsRecipe):
    """``recipe``'s model call and refusals, with ``compute_loss_func(outputs, labels, num_items_in_batch=None)``
    as the loss."""

    def __init__(self, recipe: OutputsRecipe, compute_loss_func: Callable[..., Any]) -> None:
        super().__init__(recipe.per_sample_loss, recipe.causal, custom="compute_loss_func")
        self.compute_loss_func = compute_loss_func
        self.family = recipe

    def check(self, trainer: Trainer) -> None:
        self.family.check(trainer)  # the trainer family's own refusals (TRL's loss options, ...)

    def summed(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        return self.compute_loss_func(outputs, labels, num_items_in_batch=None)

    def row_losses(self, trainer: Trainer, model: Any, inputs: dict) -> None:
        return None  # the function returns the sum, rows unseen


def with_compute_loss_func(recipe: LossRecipe, trainer: Trainer) -> LossRecipe:
    """``recipe``, or for a Trainer given ``compute_loss_func`` whose loss is HF's ``compute_loss`` (where HF calls
    it; a subclass with its own ``compute_loss`` never does), the recipe that calls it."""
    compute_loss_func = getattr(trainer, "compute_loss_func", None)
    if compute_loss_func is None or not isinstance(recipe, OutputsRecipe):
        return recipe
    return ComputeLossFuncRecipe(recipe, compute_loss_func)


__all__ = ["ComputeLossFuncRecipe", "with_compute_loss_func"]
