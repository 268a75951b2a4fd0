"""One captured layer call (``LayerCall``) and what is read from it: its per-sample gradients.

A call's scale (the batch size, for a mean loss) goes on the smaller of its output gradient and its
per-sample gradients (``sampled_grads``). ``affine_layout`` tells the built-in ``nn.Linear`` / HF
``Conv1D`` norm samplers apart from any other; ``plain_embedding`` whether a call is an
``nn.Embedding`` lookup that ``Instantiate`` may keep as rows. What a norm sampler's norm pass keeps
for its clipped sum (``NormSampler.kept_clipped_sum``) is the call's own (``NormPass``): never another
call's, never after the call's tensors changed, and gone with the call when its round is cleared.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.layers.embedding import embedding_grad_sampler
from dptorch.grad_sample.layers.hf_conv1d import hf_conv1d_clipped_sum, hf_conv1d_grad_sampler, hf_conv1d_norm_sampler
from dptorch.grad_sample.layers.linear import linear_clipped_sum, linear_grad_sampler, linear_norm_sampler, param_shape
from dptorch.grad_sample.layers.registry import GradSampler, NormSampler
from dptorch.grad_sample.units.packed_affine import layout_of, packed_per_unit_grads
from dptorch.grad_sample.units.token_units import TokenUnits

#: Built-in samplers whose results are new tensors that nothing else references.
FRESH_RESULT_SAMPLERS = frozenset({linear_grad_sampler, hf_conv1d_grad_sampler, embedding_grad_sampler})
#: Built-in samplers that take ``empty=`` (memory for their per-sample weight gradients) and ``scale=``.
POOLED_SAMPLERS = frozenset({linear_grad_sampler, hf_conv1d_grad_sampler})


@dataclass
class NormPass:
    """What one call's norm pass kept for its clipped sum, and the tensors (and their versions) it read."""

    kept: Dict[str, Any]
    sources: Tuple[torch.Tensor, ...]
    versions: Tuple[Optional[int], ...]

    def read(self, tensors: Tuple[torch.Tensor, ...]) -> bool:
        """Whether ``tensors`` are the very ones it read, unmodified since."""
        return len(tensors) == len(self.sources) and all(
            t is s for t, s in zip(tensors, self.sources)) and _versions(tensors) == self.versions


def _versions(tensors: Tuple[torch.Tensor, ...]) -> Tuple[Optional[int], ...]:
    return tuple(None if t.is_inference() else t._version for t in tensors)  # (inference tensors keep none)


@dataclass
class LayerCall:
    """One captured call of a layer: its module, trainable params, inputs and output gradient."""

    name: str
    module: nn.Module
    params: Dict[str, nn.Parameter]
    sampler: Optional[GradSampler]
    norm_sampler: Optional[NormSampler]
    activations: Tuple[torch.Tensor, ...]
    backprops: torch.Tensor
    scale: float = 1.0  # backprops times scale are the per-sample gradients of the outputs
    # Per-sample gradients (without ``scale``) the norms instantiated: the clipped sum reads them.
    per_sample: Optional[Dict[nn.Parameter, torch.Tensor]] = None
    # A built-in Linear / Conv1D call of a packed forward, kept as its (B, T, ...) tensors (``packed_affine``):
    # the token units, and the tokens whose weight gradient the norms did not instantiate (None: all were).
    units: Optional[TokenUnits] = None
    unkept_tokens: Optional[torch.Tensor] = None
    # What the norm sampler's norm pass kept for its clipped sum (``norms_sq``, ``kept_norm_pass``).
    norm_pass: Optional[NormPass] = None

    def scaled_backprops(self) -> torch.Tensor:
        return self.backprops * self.scale if self.scale != 1.0 else self.backprops

    def norms_sq(self) -> Dict[nn.Parameter, torch.Tensor]:
        """The norm sampler's squared norms of this call; a sampler with ``kept_clipped_sum`` keeps its
        norm pass in ``norm_pass``."""
        sampler = self.norm_sampler
        if sampler.kept_clipped_sum is None:
            return sampler.norms_sq(self.module, self.activations, self.backprops)
        sources = (self.backprops, *self.activations)
        versions, kept = _versions(sources), {}
        squared = sampler.norms_sq(self.module, self.activations, self.backprops, keep=kept)
        self.norm_pass = NormPass(kept, sources, versions)
        return squared

    def kept_norm_pass(self) -> Optional[Dict[str, Any]]:
        """What this call's norm pass kept, if the call still holds the tensors it read, unmodified;
        else None (the clipped sum is recomputed)."""
        held = self.norm_pass
        return held.kept if held is not None and held.read((self.backprops, *self.activations)) else None

    @property
    def samples(self) -> int:
        """Rows of its per-sample results: the batch's, or the packed forward's units."""
        if self.units is not None:
            return self.units.num_units
        return self.backprops.shape[0] if self.backprops.dim() else 1

    def regrouped(self) -> "LayerCall":
        """A packed call in the generic one-unit-per-row layout (``TokenUnits.group``)."""
        if self.units is None:
            return self
        return dataclasses.replace(self, activations=tuple(self.units.group(a) for a in self.activations),
                                   backprops=self.units.group(self.backprops), units=None, per_sample=None,
                                   norm_pass=None)


def sampled_grads(call: LayerCall, empty: Callable[..., torch.Tensor]) -> Tuple[Dict[nn.Parameter, torch.Tensor], bool]:
    """The call's per-sample gradients from its sampler, and whether their memory is new and ours.

    They are linear in the output gradient, so the call's scale goes on whichever is smaller: the
    output gradient before (``(B, T, p)``) or the per-sample gradients after (``B`` times the
    parameters: smaller when ``T`` exceeds the input width, and for a large output head); the
    built-in Linear / Conv1D samplers take it into their matmul instead, and their memory from
    ``empty`` (a ``BufferPool``'s).
    """
    if call.units is not None:  # a packed Linear / Conv1D call: per unit, bucket by bucket
        in_by_out = affine_layout(call.norm_sampler)
        return packed_per_unit_grads(call.module, call.activations[0], call.backprops, layout_of(call.units),
                                     in_by_out, call.scale), True
    if call.sampler in POOLED_SAMPLERS:
        return call.sampler(call.module, call.activations, call.backprops, empty=empty, scale=call.scale), True
    fresh = call.sampler in FRESH_RESULT_SAMPLERS
    batch = call.backprops.shape[0] if call.backprops.dim() else 1
    after = call.scale != 1.0 and call.backprops.numel() > batch * sum(math.prod(param_shape(p)) for p in call.params.values())
    grads = call.sampler(call.module, call.activations, call.backprops if after else call.scaled_backprops())
    if after and isinstance(grads, Mapping):
        grads = {p: g if g is None else g.mul_(call.scale) if fresh else g * call.scale for p, g in grads.items()}
        fresh = True
    return grads, fresh


def plain_embedding(call: LayerCall) -> bool:
    """An ``nn.Embedding`` call (built-in sampler, no ``scale_grad_by_freq``) of a trainable weight."""
    module = call.module
    return (
        call.sampler is embedding_grad_sampler
        and not getattr(module, "scale_grad_by_freq", True)
        and len(call.activations) == 1
        and not call.activations[0].is_floating_point()
        and getattr(module, "weight", None) is not None
        and len(param_shape(module.weight)) == 2
        and len(call.params) == 1
        and all(p is module.weight for p in call.params.values())
    )


def affine_layout(norm_sampler) -> Optional[bool]:
    """``in_by_out`` for the built-in ``nn.Linear`` / HF ``Conv1D`` norm samplers, None for any other."""
    if norm_sampler is None:
        return None
    if norm_sampler.norms_sq is linear_norm_sampler and norm_sampler.clipped_sum is linear_clipped_sum:
        return False
    if norm_sampler.norms_sq is hf_conv1d_norm_sampler and norm_sampler.clipped_sum is hf_conv1d_clipped_sum:
        return True
    return None
