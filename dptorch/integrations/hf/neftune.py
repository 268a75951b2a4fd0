"""NEFTune for the private Trainer: embedding noise scaled by each sample's own length.

NEFTune (Jain et al., 2023) adds uniform noise to the input embeddings of every training forward,
of magnitude ``alpha / sqrt(L * d)`` (``d`` the embedding width, ``L`` the sequence length).
transformers' hook takes ``L`` from the padded batch, the longest sample drawn: the noise a sample
gets then depends on which other samples share its batch, so its gradient does too.

Here ``L`` is each row's own length, the number of its tokens that ``attention_mask`` keeps, and
only those tokens get noise (padding, which no real token attends to, gets none): row ``i`` gets
``U(-1, 1) * alpha / sqrt(L_i * d)`` on its tokens, a distribution that is a function of row ``i``
alone. The noise is input noise in training forwards only (eval and generation see none), as in
transformers, drawn from torch's generator of the embedding's device (``TrainingArguments.seed``).

The noise is a regulariser, not part of the DP guarantee: the guarantee comes from the Gaussian noise
of the DP optimizer, and holds for any per-sample computation, NEFTune's included. What NEFTune must
not do is make one sample's gradient depend on another sample, which is why the scale is per row.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

#: The root call's keyword pairs: the ids an embedding call may embed, and the mask of their tokens.
_MASKED_INPUTS = (("input_ids", "attention_mask"), ("decoder_input_ids", "decoder_attention_mask"))


def neftune_scale(mask: torch.Tensor, width: int, alpha: float) -> torch.Tensor:
    """Each row's noise magnitude ``alpha / sqrt(L_i * width)``, ``L_i`` the row's kept tokens (at least 1),
    shape ``(B,)``: a function of the row's own mask only."""
    lengths = mask.reshape(mask.shape[0], -1).sum(dim=1).clamp(min=1)
    return alpha / torch.sqrt(lengths.to(torch.float32) * float(width))


def neftune_noise(embeddings: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """Noise for ``embeddings`` ``(B, T, d)``: uniform in ``(-s_i, s_i)`` on row ``i``'s kept tokens, 0 on its
    padding, with ``s_i = neftune_scale(mask, d, alpha)[i]``."""
    scale = neftune_scale(mask, embeddings.shape[-1], alpha).to(embeddings.dtype)
    unit = torch.empty_like(embeddings).uniform_(-1.0, 1.0)
    kept = mask.to(embeddings.dtype).unsqueeze(-1)
    return unit * kept * scale.view(-1, *([1] * (embeddings.dim() - 1)))


class PrivateNEFTune:
    """NEFTune's per-sample variant on a model: a pre-hook on the model takes the masks of its call, a hook on
    its input embedding adds :func:`neftune_noise` in training forwards. ``follow(model)`` (re)attaches to
    ``model`` (a new one from ``model_init``); ``remove()`` takes the hooks off."""

    def __init__(self, alpha: float) -> None:
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"neftune_noise_alpha must be a positive number, got {alpha!r}")
        self.alpha = float(alpha)
        self.model: Any = None
        self._handles: List[Any] = []
        self._masks: List[Dict[str, Optional[torch.Tensor]]] = []  # per root call in progress: ids' data -> mask

    def follow(self, model: Any) -> None:
        if model is self.model:
            return
        self.remove()
        embedding = model.get_input_embeddings()
        if embedding is None:
            raise ValueError("neftune_noise_alpha needs a model with input embeddings (get_input_embeddings())")
        self.model = model
        self._handles = [
            model.register_forward_pre_hook(self._take_masks, with_kwargs=True),
            model.register_forward_hook(self._drop_masks, always_call=True),
            embedding.register_forward_hook(self._add_noise),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.model, self._masks = [], None, []

    def _take_masks(self, module: Any, args: tuple, kwargs: dict) -> None:
        masks = {}
        for ids_key, mask_key in _MASKED_INPUTS:
            ids = kwargs.get(ids_key, args[0] if ids_key == "input_ids" and args else None)
            if isinstance(ids, torch.Tensor):
                masks[_key(ids)] = kwargs.get(mask_key)
        self._masks.append(masks)

    def _drop_masks(self, module: Any, args: tuple, output: Any) -> None:
        if self._masks:
            self._masks.pop()

    def _add_noise(self, module: Any, args: tuple, output: torch.Tensor) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return None
        ids = args[0] if args else None
        found = self._masks[-1].get(_key(ids), False) if self._masks and isinstance(ids, torch.Tensor) else False
        if found is False or found is None or output.dim() != 3 or found.shape != output.shape[:2]:
            raise ValueError(
                "NEFTune (neftune_noise_alpha) in the private Trainer scales each sample's embedding noise by that "
                "sample's own length, read from the model call's attention_mask (decoder_attention_mask for decoder "
                "inputs); this training forward embeds ids "
                + ("whose mask is missing" if found is None
                   else "that are not the call's input_ids or decoder_input_ids")
                + ". Give the masks (the collator's attention_mask), or unset neftune_noise_alpha"
            )
        return output + neftune_noise(output, found, self.alpha)


def _key(ids: torch.Tensor) -> tuple:
    """The embedded ids, recognised through a view (models reshape them before embedding)."""
    return (ids.data_ptr(), ids.numel(), ids.device)


def take_over_neftune(trainer: Any) -> Optional[PrivateNEFTune]:
    """The per-sample NEFTune of a trainer with ``neftune_noise_alpha`` (None without): transformers' own hook,
    scaled by the padded length, is never attached (the Trainer attaches it only while its alpha is set)."""
    alpha = getattr(trainer, "neftune_noise_alpha", None)
    if alpha is None:
        return None
    trainer.neftune_noise_alpha = None
    return PrivateNEFTune(alpha)
