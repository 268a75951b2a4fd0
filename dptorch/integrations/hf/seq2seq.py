"""Encoder-decoder models (T5, BART: ``Seq2SeqTrainer``) in the private Trainer: each row's decoder inputs.

Given ``labels``, an encoder-decoder model builds its decoder inputs from them (the labels moved one place
right behind the decoder start token, ``-100`` read as padding) and returns HF's loss, a token mean over the
whole batch, which couples the samples. The private trainer calls the model without labels and takes each
row's own token mean of the decoder logits (:func:`~.losses.token_per_sample_loss`, unshifted: decoder logit
``t`` predicts label ``t``), so it gives the decoder its inputs itself: the collator's
``decoder_input_ids`` when it built them (``DataCollatorForSeq2Seq(model=...)``, as HF's label smoothing
needs too), else the model's own shift of the labels, one row at a time, so that no row's decoder inputs
can read another row's labels whatever the model's shift does.
"""

from __future__ import annotations

from typing import Any, Dict

import torch


def _base(model: Any) -> Any:
    """The model under a PEFT wrapper (``model`` itself without one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_encoder_decoder(model: Any) -> bool:
    """Whether ``model`` (or the base model under a PEFT wrapper) is an encoder-decoder model."""
    return bool(getattr(getattr(_base(model), "config", None), "is_encoder_decoder", False))


def check_decoder_inputs_buildable(model: Any) -> None:
    """Raise before any step if ``model`` cannot build decoder inputs from labels."""
    base = _base(model)
    if not callable(getattr(base, "prepare_decoder_input_ids_from_labels", None)):
        raise ValueError(
            f"{type(base).__name__} is an encoder-decoder model without prepare_decoder_input_ids_from_labels, so the "
            "private trainer cannot build its decoder inputs from the labels; give it a model that has one (T5, BART "
            "and transformers' other seq2seq models do)"
        )


def with_decoder_inputs(model: Any, inputs: Dict[str, Any], labels: torch.Tensor) -> Dict[str, Any]:
    """``inputs`` for a forward without labels: ``decoder_input_ids`` (the batch's, else each row's own labels
    shifted by the model, row by row) and no key-value cache (training computes every position at once)."""
    if inputs.get("decoder_input_ids") is None and inputs.get("decoder_inputs_embeds") is None:
        shift = _base(model).prepare_decoder_input_ids_from_labels
        inputs["decoder_input_ids"] = torch.cat([shift(labels=row) for row in labels.split(1)])
    inputs["use_cache"] = False
    return inputs
