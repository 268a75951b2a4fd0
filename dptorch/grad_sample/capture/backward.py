"""The backward of a captured call of a layer with a grad sampler: its inputs and output gradient laid
out one row per sample (or privacy unit), or kept packed, and handed to the mode's strategy as a
``LayerCall``."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import nn

from dptorch.distributed.tensor_parallel import local_part
from dptorch.grad_sample.capture.attachment import HookedLayer
from dptorch.grad_sample.capture.rounds import Rounds
from dptorch.grad_sample.capture.settings import Settings, Switches
from dptorch.grad_sample.capture.sharding import Sharding
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.modes.layer_call import LayerCall, affine_layout
from dptorch.grad_sample.tracking import INNER, CallBatch, origin_grads, rows_to_dense
from dptorch.grad_sample.units.token_units import TokenUnits


class CallBackward:
    """Hands the backward of each captured sampler call to the held round's strategy."""

    def __init__(self, settings: Settings, switches: Switches, sharding: Sharding, rounds: Rounds) -> None:
        self._settings, self._switches, self._sharding, self._rounds = settings, switches, sharding, rounds

    def layer_backward(self, layer: HookedLayer, params, call: CallBatch, units: Optional[TokenUnits], flat: bool,
                       activations, grad_outputs) -> None:
        if self._switches.suspended:
            return
        if flat:  # the packed tokens flattened with their rows (an MoE block's (B * T, H)): (B, T, H) again
            activations = tuple(a.unflatten(0, units.shape) for a in activations)
            grad_outputs = (grad_outputs[0].unflatten(0, units.shape), *grad_outputs[1:])
        self._rounds.begin_round()
        self._rounds.enter_units(units)
        packed = None
        sharding = self._sharding
        if id(layer.module) in sharding.replicated:  # whole weights: all tokens, or this rank's
            activations, grad_outputs = sharding.replicated_call(layer, params, call, units, activations, grad_outputs)
        elif sharding.tensor_parallel_modules:  # each rank's slice: local inputs, local output gradients
            dims = call.input_dims if call.kind == "batched" else (None,) * len(activations)
            linear = isinstance(layer.module, nn.Linear)  # an embedding's ids must be whole
            activations = tuple(local_part(a, None if d is None else d % INNER, linear) for a, d in zip(activations, dims))
            out_dim = call.output_dims[0] if call.kind == "batched" else None
            grad_outputs = tuple(local_part(g, None if out_dim is None else out_dim % INNER) for g in grad_outputs)
            sharding.note_call(layer, params, activations, grad_outputs[0])
        if units is not None and self._packed_affine(layer, activations, grad_outputs[0], units):
            backprops, group, packed = grad_outputs[0], None, units  # kept packed (packed_affine: no (U, L) layout)
            scale = float(units.num_units) if self._settings.loss_reduction == "mean" else 1.0
        elif units is not None:  # one row per token unit, its tokens side by side (the layer is token-wise)
            activations, backprops, group = tuple(units.group(a) for a in activations), units.group(grad_outputs[0]), None
            scale = float(units.num_units) if self._settings.loss_reduction == "mean" else 1.0
        else:
            activations, backprops, group = _batch_first(call, activations, grad_outputs[0], layer.token_wise)
            scale = float(call.n) if self._settings.loss_reduction == "mean" else 1.0
        sampler, norm_sampler = layer.sampler, layer.norm_sampler
        if group:  # the batch merged with an inner dim, into a layer that is not token-wise
            sampler, norm_sampler = _summed_in_groups(sampler, group), None
        if sharding.canonical:  # FSDP2: the samplers see the gathered parameters; results go to the registered ones
            sampler = sharding.keyed_by_registered(sampler)
            if norm_sampler is not None:
                norm_sampler = dataclasses.replace(
                    norm_sampler, norms_sq=sharding.keyed_by_registered(norm_sampler.norms_sq),
                    clipped_sum=sharding.keyed_by_registered(norm_sampler.clipped_sum),
                    linear_form=sharding.keyed_by_registered(norm_sampler.linear_form),
                    kept_clipped_sum=sharding.keyed_by_registered(norm_sampler.kept_clipped_sum),
                )
        call = LayerCall(layer.name, layer.module, params, sampler, norm_sampler, tuple(activations), backprops, scale, units=packed)
        self._rounds.strategy.on_call(call)

    def _packed_affine(self, layer: HookedLayer, activations, backprops: Optional[torch.Tensor], units: TokenUnits) -> bool:
        """A built-in Linear / Conv1D call of a packed forward in bk / ghost mode, on ``(B, T, ...)`` tensors:
        its norms and clipped sums are formed from the packed tokens (``packed_affine``); any other layer,
        mode or layout is regrouped one unit per row."""
        return (
            self._settings.grad_sample_mode in ("bk", "ghost") and not self._sharding.canonical
            and affine_layout(layer.norm_sampler) is not None and len(activations) == 1
            and activations[0].is_floating_point() and activations[0].dim() >= 3 and backprops is not None and backprops.dim() >= 3
            and tuple(activations[0].shape[:2]) == tuple(units.shape) == tuple(backprops.shape[:2])
        )


def not_per_sample(layer: HookedLayer, t: torch.Tensor, n: int, dim: Optional[int]) -> PerSampleGradientError:
    """The refusal of a call whose tensor ``t`` does not have the batch's ``n`` rows (along ``dim``)."""
    where = f"along dim {dim}" if dim is not None else "along its batch dimension"
    return PerSampleGradientError(
        f"{layer.name} ({type(layer.module).__name__}) produced a tensor of shape {tuple(t.shape)}, which does "
        f"not have the batch's {n} rows {where}: it is shared by, or flattened across, "
        "samples, so per-sample gradients of its parameters are not defined by this call. Freeze its "
        "parameters, give it inputs with one row per sample (check batch_first), or register a grad sampler."
    )


def _summed_in_groups(sampler: Any, group: int) -> Any:
    """A grad sampler run on rows that are ``group`` consecutive rows per sample: sums each sample's."""

    def summed(module: nn.Module, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor):
        grads = sampler(module, activations, backprops)
        if not isinstance(grads, dict):  # the strategy says what a grad sampler must return
            return grads
        return {p: g.unflatten(0, (g.shape[0] // group, group)).sum(1) for p, g in grads.items()}

    return summed


def to_batch_first(t: torch.Tensor, dim: Optional[int], n: int, split: bool = True) -> torch.Tensor:
    """``t`` with its batch (along ``dim``, merged with an inner dim when ``dim >= INNER``) along dim 0;
    a merged batch is split into ``(n, inner)`` unless ``split`` is False."""
    if not dim:
        return t
    d, inner = dim % INNER, dim // INNER
    if inner and split:
        t = t.unflatten(d, (n, inner))
    return t.movedim(d, 0) if d else t


def _batch_first(call: CallBatch, activations: Sequence[torch.Tensor], grad: torch.Tensor, token_wise: bool = True):
    """A captured call's inputs and output gradient with one row per sample along dim 0, and the
    number of consecutive rows per sample when they stay merged (None: one row per sample).

    A batch merged with an inner dim of ``k`` rows is split into ``(n, k)`` for token-wise layers;
    other layers see the ``n * k`` rows as they computed them, and their rows' gradients are summed
    per sample.
    """
    n = call.n
    if call.kind == "batched":
        inners = {d // INNER for d in (*call.input_dims, call.output_dims[0]) if d is not None}
        split = token_wise or inners <= {0}
        if not split and len(inners) > 1:
            raise PerSampleGradientError(
                "a layer's inputs and output carry the batch merged with other dims in different ways; per-sample "
                "gradients need each sample's rows grouped alike"
            )
        activations = tuple(to_batch_first(a, d, n, split) for a, d in zip(activations, call.input_dims))
        return activations, to_batch_first(grad, call.output_dims[0], n, split), None if split else inners.pop()
    if call.kind == "origin":
        # Each sample's gradient of the shared output, gathered where it met the batch. When every
        # use paired the output's rows with the samples (e.g. token_type_ids expanded from a buffer),
        # the inputs' rows pair with them too (a sampler's layer works row by row).
        grad, dim = origin_grads(call.origins[0], grad, rows_ok=True)
        if dim is not None and all(a.dim() > dim and a.shape[dim] == n for a in activations):
            return tuple(a.movedim(dim, 0) for a in activations), grad.movedim(dim, 0), None
        if dim is not None:
            grad = rows_to_dense(grad, dim, n)
    else:  # at most one sample: the whole call is its
        grad = grad.expand(n, *grad.shape)
    return tuple(a.expand(n, *a.shape) for a in activations), grad, None
