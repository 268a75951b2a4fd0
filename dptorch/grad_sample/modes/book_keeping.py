"""``BookKeeping`` (modes "bk" and "ghost"): norms and clipped sums from each call's kept inputs.

It keeps each call's activations and output gradients, computes norms from them (ghost or
instantiated, per layer) and the clipped sums directly, as the batch gradient with each sample's
output gradient scaled by its clip factor: one backward.

Layers without a norm sampler, and parameters used by several calls (tied weights), are
instantiated inside ``BookKeeping`` too (by an ``Instantiate``): the norm of a shared parameter is
the norm of the sum of its uses. Built-in ``nn.Linear`` / HF ``Conv1D`` calls that read one input
tensor (q/k/v, gate/up: the same memory, never merely equal values) share its Gram matrix and its
clip-factor-scaled copy (``shared_inputs.shared_affine_norms_and_grads`` /
``shared_affine_clipped_sums``). A Linear / Conv1D norm is instantiated where its
gradient's memory allows (``shared_inputs.ghost_norms_chosen``: ``B d p`` numbers no more than the
``B T (d + p)`` of the call's factors) and kept; the call then lets its factors go, and the clipped sum
is the weighted sum of the kept gradients: one pass over ``B d p`` numbers instead of a second
``T d p`` matmul per sample; a bias keeps its per-sample gradient (the summed output gradient) the
same way. A norm sampler that keeps its norm
pass (``NormSampler.kept_clipped_sum``: the expert banks' factors) forms its clipped sum from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.modes.buffers import BufferPool
from dptorch.grad_sample.modes.instantiate import Instantiate, NameOf
from dptorch.grad_sample.modes.layer_call import LayerCall, affine_layout, plain_embedding, sampled_grads
from dptorch.grad_sample.modes.precision import float32_matmuls_at_full_precision
from dptorch.grad_sample.modes.unit_rows import group_rows_by_unit, zero_rows
from dptorch.grad_sample.norms.linear_forms import (
    WIDE_BLOCK,
    at_least_float32,
    shared_form_norms,
    stacked_map,
    weighted_sum,
    weighted_sums,
)
from dptorch.grad_sample.norms.shared_inputs import (
    AffineUse,
    ghost_norms_chosen,
    memory_key,
    shared_affine_clipped_sums,
    shared_affine_norms_and_grads,
)
from dptorch.grad_sample.units.packed_affine import layout_of, packed_affine_clipped_sums, packed_affine_norms_and_grads


class BookKeeping:
    """Norms and clipped sums from each call's kept (activations, backprops): one backward pass.

    The clipped sum of a layer is its ordinary batch gradient with sample ``i``'s output gradient
    scaled by ``c_i`` (``NormSampler.clipped_sum``); modes "bk" and "ghost" both use it.
    """

    def __init__(self, name_of: NameOf, buffers: BufferPool) -> None:
        self.name_of = name_of
        self.dense = Instantiate(name_of, buffers)
        self.calls: List[LayerCall] = []
        self._norms: Optional[Dict[nn.Parameter, torch.Tensor]] = None
        self._shared: set = set()

    @property
    def grads(self) -> Dict[nn.Parameter, torch.Tensor]:
        return self.dense.grads

    def on_call(self, call: LayerCall) -> None:
        if call.norm_sampler is None:
            self.dense.on_call(call)
        else:
            self.calls.append(call)

    def add(self, call: LayerCall, grads: Dict[nn.Parameter, torch.Tensor], fresh: bool = False) -> None:
        """Sum ``grads`` into the held per-sample gradients; ``fresh``: their memory is ours."""
        self.dense.add(call, grads, fresh)

    def finish_round(self, unit_ids: Optional[torch.Tensor]) -> None:
        uses = Counter(p for call in self.calls for p in call.params.values())
        uses.update(self.dense.covers())
        factored = self._factored_shared_params(uses, unit_ids)
        kept = []
        for call in self.calls:
            if call.units is not None and any(p in factored for p in call.params.values()):
                call = call.regrouped()  # its linear form meets the other uses' in the (U, L) layout
            shared = {n: p for n, p in call.params.items() if uses[p] > 1 and p not in factored}
            if unit_ids is not None and not call.norm_sampler.token_wise:
                shared = call.params
            if shared:
                if plain_embedding(call) and list(shared.values()) == [call.module.weight]:
                    self.dense.on_call(dataclasses.replace(call, params=shared))  # its rows, added to the other uses'
                else:
                    grads = sampled_grads(call, self.dense.buffers.empty)
                    self.dense.add(LayerCall(call.name, call.module, shared, None, None, (), call.backprops), *grads)
                call.params = {n: p for n, p in call.params.items() if n not in shared}
            if not call.params:
                continue
            if unit_ids is not None:
                call.activations = tuple(group_rows_by_unit(a, unit_ids) for a in call.activations)
                call.backprops = group_rows_by_unit(call.backprops, unit_ids)
            kept.append(call)
        self.calls = kept
        self._shared = factored
        self.dense.finish_round(unit_ids)
        self._norms = None

    def _factored_shared_params(self, uses: Counter, unit_ids: Optional[torch.Tensor]) -> set:
        """Shared parameters whose every use has a linear form: their norm comes from the factors."""
        dense = self.dense.covers()
        candidates = {p for p, count in uses.items() if count > 1 and p not in dense}
        for call in self.calls:
            if call.norm_sampler.linear_form is None or (unit_ids is not None and not call.norm_sampler.token_wise):
                candidates -= set(call.params.values())
            elif not _factors_cheaper(call):
                candidates -= set(call.params.values())
        return candidates

    def covers(self) -> set:
        return self.dense.covers() | {p for call in self.calls for p in call.params.values()}

    def per_sample_norms(self) -> Dict[nn.Parameter, torch.Tensor]:
        if self._norms is None:
            with torch.no_grad(), float32_matmuls_at_full_precision():
                self._norms = self._compute_norms()
        return self._norms

    def _compute_norms(self) -> Dict[nn.Parameter, torch.Tensor]:
        norms = self.dense.per_sample_norms()
        squares: List[Tuple[nn.Parameter, torch.Tensor, float]] = []  # (param, squared norms, the call's scale)
        forms: Dict[nn.Parameter, list] = {}
        affine_calls, affine_uses = [], []
        packed_calls, packed_uses = [], []
        for call in self.calls:
            own = [p for p in call.params.values() if p not in self._shared]
            use = _affine_use(call, own)
            if use is not None and call.units is not None:  # packed tokens: packed_affine's buckets
                packed_calls.append(call)
                packed_uses.append(use)
            elif use is not None:  # Linear / Conv1D: one Gram per shared input (shared_inputs.shared_affine_norms_sq)
                affine_calls.append(call)
                affine_uses.append(use)
            elif own:
                squared = call.norms_sq()
                squares += [(param, squared[param], call.scale) for param in own]
            if len(own) < len(call.params):
                for param, form in call.norm_sampler.linear_form(call.module, call.activations, call.backprops).items():
                    if param in self._shared:
                        forms.setdefault(param, []).append((call.scale, form))
        handed = [_hand_over(call, use) for call, use in zip(affine_calls, affine_uses)]
        computed = shared_affine_norms_and_grads(affine_uses, release=True)
        for call, use, squared, grads, moved in zip(affine_calls, affine_uses, *computed, handed):
            squares += [(param, value, call.scale) for param, value in squared.items()]
            call.per_sample = grads or None
            if moved and use.inputs is not None:  # not released: the clipped sum reads the factors
                call.activations, call.backprops = (use.inputs,), use.backprops
        if packed_calls:
            squared, kept = packed_affine_norms_and_grads(packed_uses, layout_of(packed_calls[0].units))
            for call, value, held in zip(packed_calls, squared, kept):
                squares += [(param, v, call.scale) for param, v in value.items()]
                call.per_sample, call.unkept_tokens = held.grads, held.unkept_tokens
        for (param, _, scale), norm in zip(squares, stacked_map(_root, [value for _, value, _ in squares])):
            norms[param] = norm if scale == 1.0 else norm * scale
        for param, uses in forms.items():
            norms[param] = shared_norm(uses)
        return norms

    def clipped_sums(self, factors: Dict[nn.Parameter, torch.Tensor], dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
        sums = self.dense.clipped_sums(factors, dropped)
        with torch.no_grad(), float32_matmuls_at_full_precision():
            affine_uses, affine_factors = [], []
            packed_uses, packed_factors, packed_tokens, layout = [], [], [], None
            zeroed_inputs: Dict[object, torch.Tensor] = {}  # dropped units: one zeroed copy per shared input
            scaled_factors: Dict[Tuple[int, float], torch.Tensor] = {}

            def scaled_factor(param: nn.Parameter, scale: float) -> torch.Tensor:
                # One tensor per (factor, scale): the uses sharing an input then share its scaled copy.
                key = (id(factors[param]), scale)
                if key not in scaled_factors:
                    scaled_factors[key] = at_least_float32(factors[param]) * scale
                return scaled_factors[key]

            kept_params, kept_pairs = [], []  # instantiated by the norms: one pass over each
            for call in self.calls:
                kept = call.per_sample or {}
                for param in kept:
                    if param in factors:
                        kept_params.append(param)
                        kept_pairs.append((scaled_factor(param, call.scale), zero_rows(kept[param], dropped)))
                wanted = [p for p in call.params.values() if p in factors and p not in kept]
                if call.units is not None:  # packed tokens: one matmul over the tokens not kept (packed_affine)
                    weight = getattr(call.module, "weight", None)
                    if call.per_sample is not None:  # after the norms: only the weight may remain
                        wanted = [p for p in call.params.values() if p is weight and p in factors and call.unkept_tokens is not None]
                    use = _affine_use(call, wanted)
                    if use is not None:
                        layout = layout_of(call.units)
                        packed_uses.append(use)
                        packed_factors.append(tuple(
                            None if p is None else scaled_factor(p, call.scale) for p in (use.weight, use.bias)
                        ))
                        packed_tokens.append(call.unkept_tokens if call.per_sample is not None else None)
                    continue
                if kept and not wanted:
                    continue
                use = _affine_use(call, wanted, self._shared)
                if use is not None:  # Linear / Conv1D: the shared input scaled once per factor
                    # The factor stays float32 (a bf16 factor may round up past C / ||g_i||).
                    affine_uses.append(use if dropped is None else _without_units(use, dropped, zeroed_inputs))
                    affine_factors.append(tuple(
                        None if p is None else scaled_factor(p, call.scale) for p in (use.weight, use.bias)
                    ))
                    continue
                norm_pass = call.kept_norm_pass()
                if norm_pass is not None:  # the norm pass's own factors: the sum is of the gradient it bounded
                    for _, params in _group_by_factor(call.params.values(), factors):
                        computed = call.norm_sampler.kept_clipped_sum(
                            call.module, norm_pass, scaled_factor(params[0], call.scale), dropped)
                        for param in params:
                            summed = computed[param].float()
                            sums[param] = summed + sums[param] if param in sums else summed
                    continue
                if dropped is not None and any(a.is_floating_point() for a in call.activations):
                    # A sampler's row i depends on sample i's rows only: dropped rows are zeroed after it.
                    grads = sampled_grads(call, self.dense.buffers.empty)[0]
                    for param in wanted:
                        summed = weighted_sum(at_least_float32(factors[param]), zero_rows(grads[param], dropped)).float()
                        sums[param] = summed + sums[param] if param in sums else summed
                    continue
                backprops = zero_rows(at_least_float32(call.backprops), dropped)
                for factor, params in _group_by_factor(call.params.values(), factors):
                    # The factor stays float32 (a bf16 factor may round up past C / ||g_i||).
                    scale = (factor.to(backprops.dtype) * call.scale).view(-1, *([1] * (backprops.dim() - 1)))
                    computed = call.norm_sampler.clipped_sum(call.module, call.activations, backprops * scale)
                    for param in params:
                        summed = computed[param].float()
                        sums[param] = summed + sums[param] if param in sums else summed
            for param, summed in zip(kept_params, weighted_sums(kept_pairs)):
                summed = summed.float()
                sums[param] = summed + sums[param] if param in sums else summed
            computed_sums = shared_affine_clipped_sums(affine_uses, affine_factors)
            if packed_uses:
                computed_sums += packed_affine_clipped_sums(packed_uses, packed_factors, packed_tokens, layout, dropped)
            for computed in computed_sums:
                for param, summed in computed.items():
                    sums[param] = summed + sums[param] if param in sums else summed
        return sums

    def batch_size(self) -> int:
        if self.calls:
            return self.calls[0].samples
        return self.dense.batch_size()


def _hand_over(call: LayerCall, use: AffineUse) -> bool:
    """Whether ``call``'s factors were moved into ``use`` (every parameter of the call is the use's): the use
    may then release them (``shared_affine_norms_and_grads``). The call keeps an empty ``(B, 0)`` output
    gradient meanwhile (its rows stay countable: ``LayerCall.samples``)."""
    if any(p is not use.weight and p is not use.bias for p in call.params.values()):
        return False
    call.activations, call.backprops = (), call.backprops.new_empty((call.backprops.shape[0], 0))
    return True


def _without_units(use: AffineUse, dropped: torch.Tensor, zeroed_inputs: Dict[object, torch.Tensor]) -> AffineUse:
    """``use`` with the dropped units' input and output-gradient rows zeroed; uses that read one input
    share its zeroed copy (``zeroed_inputs``, by memory), so they stay one group."""
    key = memory_key(use.inputs)
    if key not in zeroed_inputs:
        zeroed_inputs[key] = zero_rows(use.inputs, dropped)
    return dataclasses.replace(use, inputs=zeroed_inputs[key], backprops=zero_rows(use.backprops, dropped))


def _affine_use(call: LayerCall, wanted, shared: Optional[set] = None) -> Optional[AffineUse]:
    """The call as an ``AffineUse`` of its wanted params, if its layer is a built-in Linear / Conv1D; with
    ``shared`` (the round's parameters of several uses, normed by ``shared_norm``), marked ``sole_use`` where its
    weight is not one of them."""
    if not wanted:
        return None
    in_by_out = affine_layout(call.norm_sampler)
    if in_by_out is None or len(call.activations) != 1:
        return None
    module = call.module
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if any(p is not weight and p is not bias for p in wanted):
        return None
    return AffineUse(
        call.activations[0], call.backprops,
        weight if any(p is weight for p in wanted) else None,
        bias if bias is not None and any(p is bias for p in wanted) else None,
        in_by_out,
        sole_use=shared is not None and weight is not None and weight not in shared,
    )


def _root(squared: torch.Tensor) -> torch.Tensor:
    """Norms in float32 from squared norms (a rounded square may come out below 0)."""
    return squared.float().clamp(min=0).sqrt()


def _factors_cheaper(call: LayerCall) -> bool:
    """Whether a shared use's norm comes from its factors (``ghost_norms_chosen``, the rule of unshared uses:
    memory decides); index (embedding) inputs and single tokens make the factors cheap whatever the shape."""
    inputs = call.activations[0] if call.activations else None
    if inputs is None or not inputs.is_floating_point():
        return True
    if call.units is not None:  # as in the (U, L) layout
        tokens = call.units.width * (math.prod(call.backprops.shape[2:-1]))
    else:
        tokens = math.prod(call.backprops.shape[1:-1]) if call.backprops.shape[0] else 0
    return tokens <= 1 or ghost_norms_chosen(tokens, inputs.shape[-1], [call.backprops.shape[-1]])


def shared_norm(uses) -> torch.Tensor:
    """Certified per-sample norm of ``sum_k s_k G_k`` from each use's scale ``s_k`` and linear form
    ``G_k`` (cross terms included: ``linear_forms.shared_form_norms``), a block of samples at a time:
    no wide copy of a factor and no Gram it forms holds more than ``WIDE_BLOCK`` elements (a tied LM
    head's ``(B, T, vocab)`` output gradient is never copied whole). Each sample's norm is its own."""
    forms = [form for _, form in uses]
    batch = forms[0].right.shape[0]
    per_sample = max(form.tokens * max(form.tokens, form.width) for form in forms)
    rows = max(1, WIDE_BLOCK // max(1, per_sample))
    if rows >= batch or any(form.left.shape[0] != batch or form.right.shape[0] != batch for form in forms):
        return shared_form_norms(uses)
    blocks = []
    for start in range(0, batch, rows):
        # One slice per form object: a form entering several uses stays one object (its pairs' weights).
        block = {id(form): dataclasses.replace(form, left=form.left[start:start + rows], right=form.right[start:start + rows])
                 for form in forms}
        blocks.append(shared_form_norms([(scale, block[id(form)]) for scale, form in uses], samples=batch))
    return torch.cat(blocks)


def _group_by_factor(params, factors: Dict[nn.Parameter, torch.Tensor]):
    """Pairs (factor, params sharing it): flat clipping gives one group per layer call."""
    groups: List[Tuple[torch.Tensor, List[nn.Parameter]]] = []
    for param in params:
        if param not in factors:
            continue
        factor = factors[param]
        for held, members in groups:
            if held is factor:
                members.append(param)
                break
        else:
            groups.append((factor, [param]))
    return groups
