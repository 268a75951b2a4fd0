"""Loss recipes: how each trainer family yields the SUM of per-unit losses, and its row layout.

The private trainer's controller runs with ``loss_reduction="sum"``: the loss of a micro-batch
must be the sum over its privacy units of each unit's own loss. A recipe knows how to get that
from one trainer family, which settings of that family it must refuse, and which batch rows
belong to which example:

* :class:`OutputsRecipe` (``Trainer`` and subclasses that keep its ``compute_loss``, ``Seq2SeqTrainer``
  included): calls the model without labels and sums a per-sample loss of its outputs
  (``per_sample_loss_func``); an encoder-decoder model gets decoder inputs from each row's labels (:mod:`.seq2seq`).
* :class:`SFTRecipe` (``trl.SFTTrainer``): the same, bypassing TRL's fused LM head and its
  batch-token normalisation.
* :class:`PreferenceRecipe` (``trl.DPOTrainer``): TRL's own pair losses, un-averaged (times the
  pairs in the micro-batch); each example is two rows (chosen, then rejected).
* :class:`ChunkedLMRecipe` (``per_sample_loss_func=ChunkedCausalLMLoss()``, a causal LM under ``Trainer`` or
  ``SFTTrainer``): the same per-row token mean, computed by the model's head block by block of the vocabulary so
  that the ``(B, T, V)`` logits are never held (:mod:`dptorch.grad_sample.units.chunked_lm_loss`).
* :class:`DeclaredSumRecipe`: a subclass whose ``compute_loss`` declares, by the class attribute
  ``compute_loss_sums_per_sample_losses = True``, that it already returns such a sum.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from transformers import Trainer

from dptorch.grad_sample.units.chunked_lm_loss import ChunkedCausalLMLoss
from dptorch.grad_sample.units.packed_loss import packed_loss
from dptorch.grad_sample.units.per_sample_losses import (
    PerSampleLoss,
    check_label_padding,
    check_per_sample_losses,
    default_per_sample_loss,
    logits_of,
)
from dptorch.integrations.hf.seq2seq import check_decoder_inputs_buildable, is_encoder_decoder, with_decoder_inputs

ComputeLoss = Callable[..., Any]

#: DPO loss types whose value for one pair depends on the other pairs of the batch.
CROSS_SAMPLE_DPO_LOSSES = {
    "aot": "sorts the log-ratios across the batch",
    "aot_unpaired": "sorts the log-ratios across the batch",
    "sft": "averages the chosen tokens of the whole batch",
}


class LossRecipe:
    """One example per row; nothing refused. Subclasses say how to get the summed loss."""

    rows_per_example = 1

    def check(self, trainer: Trainer) -> None:
        """Raise if the trainer is configured in a way this recipe cannot keep private."""

    def summed_loss(self, trainer: Trainer, model: Any, inputs: dict, return_outputs: bool, parent: ComputeLoss) -> Any:
        """The micro-batch loss: a sum over units of each unit's own loss (``parent`` is the trainer's compute_loss)."""
        raise NotImplementedError

    def row_losses(self, trainer: Trainer, model: Any, inputs: dict) -> Optional[torch.Tensor]:
        """Each row's own loss (``summed_loss`` is their sum), or None where the recipe sums them unseen."""
        return None

    def row_unit_ids(self, example_unit_ids: Optional[torch.Tensor], inputs: dict) -> Optional[torch.Tensor]:
        """One unit id per batch row, or None when every row is its own unit."""
        return example_unit_ids


class OutputsRecipe(LossRecipe):
    """Call the model without labels and sum ``per_sample_loss(outputs, labels)`` over rows."""

    def __init__(self, per_sample_loss: PerSampleLoss, causal: bool, custom: Optional[str] = None) -> None:
        self.per_sample_loss = per_sample_loss
        self.causal = causal
        self.custom = custom  # the name of the user's loss function (it sees rows: not for packed rows), or None

    def check(self, trainer: Trainer) -> None:
        check_label_padding(trainer.data_collator)
        if is_encoder_decoder(trainer.model):
            check_decoder_inputs_buildable(trainer.model)

    def summed_loss(self, trainer: Trainer, model: Any, inputs: dict, return_outputs: bool, parent: ComputeLoss) -> Any:
        outputs, labels = self.outputs(trainer, model, inputs)
        if trainer.dp_hooks.unit_kind == "tokens":  # examples packed in rows (packing.py): each its own loss
            if self.custom:
                raise ValueError(f"{self.custom} sees rows, but this batch packs several examples in a row; leave it "
                                 "out (each packed example gets dptorch.packed_loss)")
            loss = packed_loss(logits_of(outputs), labels, trainer.dp_hooks, shift=self.causal,
                               label_smoothing=trainer.args.label_smoothing_factor)
        else:
            loss = self.summed(outputs, labels)
        return (loss, outputs) if return_outputs else loss

    def outputs(self, trainer: Trainer, model: Any, inputs: dict) -> Tuple[Any, torch.Tensor]:
        """The model's outputs for ``inputs`` called without labels, and the labels (popped from ``inputs``)."""
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError(
                f"the training batch has no 'labels' (keys: {sorted(inputs)}); the private trainer computes each "
                "sample's loss from the model outputs and the labels. Use a collator that builds labels, e.g. "
                "DataCollatorForPrivateCausalLanguageModeling"
            )
        if self.causal:
            inputs["use_cache"] = False
        elif is_encoder_decoder(trainer.model):  # called without labels: the decoder inputs come from each row's own
            inputs = with_decoder_inputs(trainer.model, inputs, labels)
        return model(**inputs), labels

    def row_losses(self, trainer: Trainer, model: Any, inputs: dict) -> Optional[torch.Tensor]:
        if trainer.dp_hooks.unit_kind == "tokens":
            return None
        return self.per_row(*self.outputs(trainer, model, inputs))

    def per_row(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """``per_sample_loss``, checked to be one loss per row."""
        return check_per_sample_losses(self.per_sample_loss(outputs, labels), labels.shape[0])

    def summed(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """The sum over rows of each row's loss."""
        return self.per_row(outputs, labels).sum()


class SFTRecipe(OutputsRecipe):
    """``trl.SFTTrainer``: padded rows, or examples packed after sampling (``packing.py``); TRL's loss options that a
    per-sample sum cannot keep are refused."""

    def check(self, trainer: Trainer) -> None:
        super().check(trainer)
        args = trainer.args
        if getattr(args, "loss_type", "nll") != "nll":
            raise ValueError(f"SFTConfig.loss_type={args.loss_type!r} is not supported privately; use loss_type='nll'")
        if getattr(trainer, "aux_loss_enabled", False):
            raise ValueError(
                "the MoE router auxiliary loss is a batch-level loss that couples the samples; set "
                "router_aux_loss_coef=0.0 in SFTConfig"
            )


class ChunkedLMRecipe(SFTRecipe):
    """A causal LM's per-row loss from its ``ChunkedLMHead`` (installed by ``check``, before the controller
    attaches): the logits are never held whole. Packed rows and label smoothing are refused."""

    def __init__(self, loss: ChunkedCausalLMLoss) -> None:
        super().__init__(loss, causal=True, custom="per_sample_loss_func=ChunkedCausalLMLoss()")
        self.loss = loss

    def check(self, trainer: Trainer) -> None:
        super().check(trainer)
        if trainer.args.label_smoothing_factor:
            raise ValueError("ChunkedCausalLMLoss has no label smoothing; set label_smoothing_factor=0 or leave "
                             "per_sample_loss_func out (the default loss smooths from the logits)")
        if getattr(trainer, "compute_loss_func", None) is not None:
            raise ValueError("compute_loss_func reads the logits, which ChunkedCausalLMLoss never forms; give one of "
                             "the two")
        self.loss.install(trainer.model)

    def summed_loss(self, trainer: Trainer, model: Any, inputs: dict, return_outputs: bool, parent: ComputeLoss) -> Any:
        losses, outputs = self.losses(trainer, model, inputs)
        loss = losses.sum()
        return (loss, outputs) if return_outputs else loss

    def row_losses(self, trainer: Trainer, model: Any, inputs: dict) -> Optional[torch.Tensor]:
        return self.losses(trainer, model, inputs)[0]

    def losses(self, trainer: Trainer, model: Any, inputs: dict) -> Tuple[torch.Tensor, Any]:
        """Each row's loss and the model's outputs (the labels popped from ``inputs``)."""
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError(f"the training batch has no 'labels' (keys: {sorted(inputs)}); ChunkedCausalLMLoss "
                             "computes each sample's loss from them")
        if trainer.dp_hooks.unit_kind == "tokens":
            raise ValueError("ChunkedCausalLMLoss gives one loss per row, but this batch packs several examples in a "
                             "row; train without packing, or leave per_sample_loss_func out (dptorch.packed_loss)")
        return self.loss(model, inputs, labels)


class PreferenceRecipe(LossRecipe):
    """``trl.DPOTrainer``: TRL's mean over the pairs of a micro-batch, multiplied back into a sum."""

    rows_per_example = 2

    def check(self, trainer: Trainer) -> None:
        loss_types = getattr(trainer, "loss_types", None) or getattr(trainer.args, "loss_type", "sigmoid")
        loss_types = [loss_types] if isinstance(loss_types, str) else list(loss_types)
        cross = [t for t in loss_types if t in CROSS_SAMPLE_DPO_LOSSES]
        if cross:
            why = "; ".join(f"{t!r} {CROSS_SAMPLE_DPO_LOSSES[t]}" for t in cross)
            raise ValueError(f"DPO loss types that couple the pairs of a batch cannot be trained privately: {why}")
        if getattr(trainer, "aux_loss_enabled", False):
            raise ValueError("the MoE router auxiliary loss couples the samples; set router_aux_loss_coef=0.0")
        head = trainer.model.get_output_embeddings()
        if head is not None and any(p.requires_grad for p in head.parameters()):
            raise ValueError(
                "DPOTrainer computes log-probabilities with TRL's fused LM head, which reads lm_head.weight directly, "
                "so the LM head (and an input embedding tied to it) gets a gradient without per-sample gradients. "
                "Freeze it (model.get_output_embeddings().requires_grad_(False)) or train LoRA adapters with PEFT."
            )

    def summed_loss(self, trainer: Trainer, model: Any, inputs: dict, return_outputs: bool, parent: ComputeLoss) -> Any:
        pairs = inputs["input_ids"].shape[0] // self.rows_per_example
        result = parent(model, inputs, return_outputs=return_outputs)
        if return_outputs:
            return result[0] * pairs, result[1]
        return result * pairs

    def row_unit_ids(self, example_unit_ids: Optional[torch.Tensor], inputs: dict) -> torch.Tensor:
        """Rows ``i`` (chosen) and ``i + B`` (rejected) belong to example ``i``'s unit."""
        pairs = inputs["input_ids"].shape[0] // self.rows_per_example
        ids = torch.arange(pairs) if example_unit_ids is None else example_unit_ids
        return torch.cat([ids] * self.rows_per_example)


class DeclaredSumRecipe(LossRecipe):
    """A ``compute_loss`` that declares it returns the sum of per-sample losses; called as is."""

    def summed_loss(self, trainer: Trainer, model: Any, inputs: dict, return_outputs: bool, parent: ComputeLoss) -> Any:
        return parent(model, inputs, return_outputs=return_outputs)


def choose_recipe(trainer: Trainer, per_sample_loss_func: Optional[PerSampleLoss], skip: type) -> LossRecipe:
    """The recipe for ``trainer``'s class; ``skip`` is the private mixin (never the loss owner)."""
    owner = next(c for c in type(trainer).__mro__ if c is not skip and "compute_loss" in vars(c))
    sft, dpo = _trl_classes()
    if getattr(trainer, "compute_loss_sums_per_sample_losses", False):
        return DeclaredSumRecipe()
    if dpo is not None and owner is dpo:
        if per_sample_loss_func is not None:
            raise ValueError("per_sample_loss_func does not apply to DPOTrainer: its pair losses are per sample")
        return PreferenceRecipe()
    if isinstance(per_sample_loss_func, ChunkedCausalLMLoss):
        if not ((owner is Trainer or (sft is not None and owner is sft)) and is_causal_lm(trainer.model)):
            raise ValueError(f"ChunkedCausalLMLoss is a causal LM's loss under Trainer or SFTTrainer; got "
                             f"{type(trainer.model).__name__} under {owner.__name__}")
        return ChunkedLMRecipe(per_sample_loss_func)
    if owner is Trainer or (sft is not None and owner is sft):
        model = trainer.model
        causal = is_causal_lm(model)
        loss = per_sample_loss_func or default_per_sample_loss(
            causal, getattr(getattr(model, "config", None), "problem_type", None), trainer.args.label_smoothing_factor
        )
        custom = "per_sample_loss_func" if per_sample_loss_func is not None else None
        return SFTRecipe(loss, causal, custom) if owner is not Trainer else OutputsRecipe(loss, causal, custom)
    raise TypeError(
        f"{owner.__name__} overrides compute_loss, so dptorch cannot tell how it reduces the samples' losses. Make "
        "it return the SUM over the batch of per-sample losses (each normalised within its sample only) and set the "
        "class attribute compute_loss_sums_per_sample_losses = True."
    )


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` (or the base model under a PEFT wrapper) is a causal language model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    return name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or name.endswith(("ForCausalLM", "LMHeadModel"))


def _trl_classes():
    try:
        from trl import DPOTrainer, SFTTrainer
    except ImportError:  # TRL is optional
        return None, None
    return SFTTrainer, DPOTrainer
