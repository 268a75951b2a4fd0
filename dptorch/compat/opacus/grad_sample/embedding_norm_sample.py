"""``opacus.grad_sample.embedding_norm_sample``: per-sample gradient norms of ``nn.Embedding`` from the rows
each sample touches, without instantiating its per-sample gradients (dptorch's embedding norm sampler)."""

from __future__ import annotations

from typing import Dict, Sequence

import torch
from torch import nn

from dptorch.grad_sample.layers.embedding import embedding_norms_sq_by_rows
from dptorch.grad_sample.layers.linear import param_shape


def compute_embedding_norm_sample(
    layer: nn.Embedding, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """``{layer.weight: norms}``: each sample's gradient norm, for ids ``activations[0]`` ``(B, ...)`` and
    output gradients ``backprops`` ``(B, ..., dim)`` (batch first); ``padding_idx`` rows get no gradient."""
    if not layer.weight.requires_grad:
        return {}
    norms_sq = embedding_norms_sq_by_rows(activations[0], backprops, layer.padding_idx, param_shape(layer.weight)[0])
    return {layer.weight: norms_sq.sqrt().to(backprops.dtype)}


__all__ = ["compute_embedding_norm_sample"]
