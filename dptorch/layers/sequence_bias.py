"""``SequenceBias``: one learned vector appended to every sequence (Opacus' layer, with its grad sampler).

Input ``(N, L, E)`` with ``batch_first=True``, else ``(L, N, E)``; output one step longer, the new
last step being ``bias`` for every sample. Sample ``i``'s gradient of ``bias`` is the output
gradient at that step.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn

from dptorch.grad_sample.layers.registry import register_grad_sampler


class SequenceBias(nn.Module):
    """Append ``bias`` (shape ``(embed_dim,)``, initialised standard normal) to every sequence."""

    def __init__(self, embed_dim: int, batch_first: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.bias = nn.Parameter(torch.empty(embed_dim))
        nn.init.normal_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        shape = [1, 1, self.bias.shape[0]]
        shape[batch_dim] = x.shape[batch_dim]
        return torch.cat([x, self.bias.expand(shape)], dim=time_dim)

    def extra_repr(self) -> str:
        return f"{self.bias.shape[0]}, batch_first={self.batch_first}"


@register_grad_sampler(SequenceBias)
def sequence_bias_grad_sampler(
    module: SequenceBias, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """``backprops`` is batch first ``(N, L + 1, E)``: each sample's gradient is its last step's."""
    if not module.bias.requires_grad:
        return {}
    return {module.bias: backprops[:, -1].to(module.bias.dtype)}
