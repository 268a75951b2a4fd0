"""Per-sample causal-LM losses of a HuggingFace model without its ``(B, T, V)`` logits.

``loss = ChunkedCausalLMLoss()`` installs a :class:`~dptorch.grad_sample.layers.chunked_lm_head.ChunkedLMHead`
as the model's output embeddings (``loss.install(model)``, before ``make_private`` or the private Trainer
attach: the head must be one of the model's modules when the controller hooks them), keeping the head's very
weight (a tied input embedding stays tied, the state dict keeps its keys). ``loss(model, inputs, labels)`` then
calls the model with the labels withheld; the model's own ``self.lm_head(hidden)`` gets each row's targets (the
labels shifted by one, ``-100`` ignored) and returns each row's loss, which the model passes out as its
``logits``. Called without a pending loss (evaluation, generation) the head returns the logits as before.

It applies only where it is exact: ``install`` first proves, on a two-token probe, that the model's logits
are its head's output unchanged (no soft-capping, no logit scale: a model that transforms them is refused),
and that the head is a bias-free ``nn.Linear``.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import nn

from dptorch.grad_sample.layers.chunked_lm_head import DEFAULT_BLOCK_ELEMENTS, IGNORE_INDEX, PER_ROW, ChunkedLMHead
from dptorch.grad_sample.units.per_sample_losses import check_per_sample_losses, logits_of


def _base(model: nn.Module) -> nn.Module:
    """The model under a PEFT wrapper, or the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token label (``-100`` at the last position): causal LM targets aligned with the hidden states."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def check_logits_are_head_output(model: nn.Module, head: nn.Module) -> None:
    """Refuse a model whose logits are not its head's output unchanged (checked on a two-token probe, no grad)."""
    seen = []
    handle = head.register_forward_hook(lambda module, args, output: seen.append(output))
    was_training = model.training
    device = head.weight.device
    try:
        model.eval()
        with torch.no_grad():
            outputs = model(input_ids=torch.tensor([[1, 2]], device=device), use_cache=False)
    finally:
        handle.remove()
        model.train(was_training)
    logits = logits_of(outputs)
    if len(seen) != 1 or not isinstance(seen[0], torch.Tensor) or not torch.equal(seen[0], logits):
        raise ValueError(
            f"{type(_base(model)).__name__}'s logits are not its LM head's output as is (soft-capping, a logit scale "
            "or another transform between them), so a chunked cross-entropy of the head alone would train another "
            "loss. Leave the chunked loss out for this model (the default per-sample loss reads its logits)"
        )


class ChunkedCausalLMLoss:
    """Each row's next-token cross-entropy (mean over its own target tokens, or ``per_row="sum"``), computed by the
    model's head block by block of the vocabulary; see the module docstring. ``block_elements``: logits per block.
    """

    def __init__(self, per_row: str = "mean", block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> None:
        if per_row not in PER_ROW:
            raise ValueError(f"per_row must be one of {PER_ROW}, got {per_row!r}")
        self.per_row = per_row
        self.block_elements = int(block_elements)

    def install(self, model: nn.Module) -> ChunkedLMHead:
        """Make ``model``'s output embeddings a ChunkedLMHead over the same weight (once); returns it."""
        base = _base(model)
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        if isinstance(head, ChunkedLMHead):
            head.per_row, head.block_elements = self.per_row, self.block_elements
            return head
        if head is None or not hasattr(base, "set_output_embeddings"):
            raise ValueError(f"{type(base).__name__} has no output embeddings to compute a chunked loss with")
        chunked = ChunkedLMHead.from_linear(head, per_row=self.per_row, block_elements=self.block_elements)
        check_logits_are_head_output(model, head)
        base.set_output_embeddings(chunked)
        return chunked

    def __call__(self, model: nn.Module, inputs: dict, labels: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """``(losses, outputs)``: one loss per row of ``labels`` and the model's outputs, whose ``logits`` hold the
        same losses. ``inputs`` must not hold the labels."""
        head = _base(model).get_output_embeddings()
        if not isinstance(head, ChunkedLMHead):
            raise ValueError("the model's LM head is not a ChunkedLMHead: call ChunkedCausalLMLoss().install(model) "
                             "before make_private (or let the private Trainer install it)")
        if "labels" in inputs:
            raise ValueError("pass the labels apart from the model inputs: the model must not compute its own loss")
        with head.computing_loss(shifted_targets(labels)):
            outputs = model(**inputs, use_cache=False)
        return check_per_sample_losses(logits_of(outputs), labels.shape[0]), outputs
