"""Strategies: what the controller keeps of each layer call, and how it answers the optimizer.

Every strategy answers the same two questions (the seam of the design): each parameter's
per-sample gradient norms, and ``sum_i c_i g_i`` for given clip factors ``c``. Units named in
``dropped`` (their gradient is not finite) contribute exactly zero: their rows of every operand are
zeroed by ``torch.where`` (``zero_rows``) before any product, since ``0 * inf`` is NaN.

- ``Instantiate`` (modes "hooks", "functorch", "ew"): per-sample gradients are built in backward.
- ``BookKeeping`` (modes "bk" and "ghost"): keeps each call's activations and output gradients,
  computes norms from them (ghost or instantiated, per layer) and the clipped sums directly, as
  the batch gradient with each sample's output gradient scaled by its clip factor: one backward.

Layers without a norm sampler, and parameters used by several calls (tied weights), are
instantiated inside ``BookKeeping`` too: the norm of a shared parameter is the norm of the sum of
its uses. Built-in ``nn.Linear`` / HF ``Conv1D`` calls that read one input tensor (q/k/v,
gate/up: the same memory, never merely equal values) share its Gram matrix and its
clip-factor-scaled copy (``shared_inputs.shared_affine_norms_and_grads`` / ``shared_affine_clipped_sums``).
``Instantiate`` keeps ``nn.Embedding`` calls as rows until the round ends and adds them into the
weight's other per-sample gradient (a tied output head) instead of a dense ``(B, V, d)`` of its own,
in place when that gradient is memory it owns (``FRESH_RESULT_SAMPLERS``). A call's scale (the
batch size, for a mean loss) goes on the smaller of its output gradient and its per-sample
gradients (``sampled_grads``). In ``BookKeeping`` a Linear / Conv1D norm that was instantiated
(long sequences: ``T (d + p) >= d p``) keeps its per-sample gradient, and the clipped sum is its
weighted sum: one pass over ``B d p`` numbers instead of a second ``T d p`` matmul per sample;
a bias keeps its per-sample gradient (the summed output gradient) the same way.

Arithmetic: norms and clipped sums are formed in float32 at least, whatever the parameters' dtype
(bf16 activations and output gradients are upcast; the clip factors stay float32), and with
float32 matmuls at full precision (``float32_matmuls_at_full_precision``: no TF32 or bf16 passes,
whatever the user's global setting), so that a sample's clipped contribution is ``c_i g_i`` to
float32 rounding, which the clip factor's margin covers (``dptorch.clipping.factors``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.modes.buffers import BufferPool
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.layers.embedding import embedding_grad_sampler, embedding_rows
from dptorch.grad_sample.layers.hf_conv1d import hf_conv1d_clipped_sum, hf_conv1d_grad_sampler, hf_conv1d_norm_sampler
from dptorch.grad_sample.layers.linear import linear_clipped_sum, linear_grad_sampler, linear_norm_sampler, param_shape
from dptorch.grad_sample.norms.linear_forms import (
    at_least_float32,
    at_least_float32_dtype,
    flatten_per_sample,
    flatten_stacked,
    shared_form_norms,
    stacked_map,
    weighted_sum,
    weighted_sums,
)
from dptorch.grad_sample.units.packed_affine import (
    layout_of,
    packed_affine_clipped_sums,
    packed_affine_norms_and_grads,
    packed_per_unit_grads,
)
from dptorch.grad_sample.layers.registry import GradSampler, NormSampler
from dptorch.grad_sample.modes.stacked_calls import fits, merged, split, stack_key
from dptorch.grad_sample.units.token_units import TokenUnits
from dptorch.grad_sample.norms.shared_inputs import (
    AffineUse,
    memory_key,
    shared_affine_clipped_sums,
    shared_affine_norms_and_grads,
)

NameOf = Callable[[nn.Parameter], str]
#: Built-in samplers whose results are new tensors that nothing else references.
FRESH_RESULT_SAMPLERS = frozenset({linear_grad_sampler, hf_conv1d_grad_sampler, embedding_grad_sampler})
#: Built-in samplers that take ``empty=`` (memory for their per-sample weight gradients) and ``scale=``.
POOLED_SAMPLERS = frozenset({linear_grad_sampler, hf_conv1d_grad_sampler})


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

    def scaled_backprops(self) -> torch.Tensor:
        return self.backprops * self.scale if self.scale != 1.0 else self.backprops

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
                                   backprops=self.units.group(self.backprops), units=None, per_sample=None)


class Instantiate:
    """Per-sample gradients, summed over the calls of one backward round."""

    def __init__(self, name_of: NameOf, buffers: BufferPool) -> None:
        self.name_of = name_of
        self.buffers = buffers  # memory for the per-sample gradients built here (the controller's)
        self.grads: Dict[nn.Parameter, torch.Tensor] = {}
        # Embedding calls kept as rows (flat ids, values, batch) until the round ends: a tied
        # weight's rows are then added to the other use's dense per-sample gradient, with no
        # (B, V, d) tensor of zeros instantiated and summed for the lookup.
        self._rows: Dict[nn.Parameter, List[Tuple[torch.Tensor, torch.Tensor, int]]] = {}
        # Parameters whose held per-sample gradient is memory no one else references (made here,
        # or returned by a built-in sampler): rows and further uses are added to it in place.
        self._owned: set = set()
        self._runs: Dict[tuple, List[LayerCall]] = {}  # small calls not sampled yet, by configuration

    def on_call(self, call: LayerCall) -> None:
        if _plain_embedding(call):
            weight = call.module.weight
            rows = embedding_rows(call.module, call.activations, call.scaled_backprops())
            held = self._rows.setdefault(weight, [])
            if held and held[0][2] != rows[2]:
                raise PerSampleGradientError(
                    f"parameter {self.name_of(weight)} was used by calls with different batch sizes "
                    f"({held[0][2]} and {rows[2]}) in one backward pass; per-sample gradients need one "
                    "row per sample in every call"
                )
            held.append(rows)
            return
        key = None if torch.is_grad_enabled() else stack_key(call)  # (a sampler building a graph goes alone)
        if key is None:
            self.add(call, *sampled_grads(call, self.buffers.empty))
            return
        run = self._runs.setdefault(key, [])
        if not fits(run, call):
            self._sample_run(self._runs.pop(key))
            run = self._runs[key] = []
        run.append(call)  # sampled with the other calls of its configuration (``stacked_calls``)

    def _sample_runs(self) -> None:
        """Sample the calls waiting in runs (before anything reads the per-sample gradients)."""
        runs, self._runs = self._runs, {}
        for run in runs.values():
            self._sample_run(run)

    def _sample_run(self, run: List[LayerCall]) -> None:
        with torch.no_grad():  # as in the backward pass the calls came from
            if len(run) == 1:  # alone: no concatenated copy
                self.add(run[0], *sampled_grads(run[0], self.buffers.empty))
                return
            grads, fresh = sampled_grads(merged(run), self.buffers.empty)
        for call, own in zip(run, split(run, grads)):
            self.add(call, own, fresh)

    def _place_rows(self) -> None:
        """Add the kept embedding rows into each weight's per-sample gradient (dense from here on)."""
        for weight, uses in self._rows.items():
            batch = uses[0][2]
            ids = torch.cat([u[0] for u in uses]) if len(uses) > 1 else uses[0][0]
            held = self.grads.get(weight)
            if held is not None and held.shape[0] != batch:
                raise PerSampleGradientError(
                    f"parameter {self.name_of(weight)} was used by calls with different batch sizes "
                    f"({held.shape[0]} and {batch}) in one backward pass; per-sample gradients need one "
                    "row per sample in every call"
                )
            dtype = weight.dtype if held is None else held.dtype
            values = torch.cat([u[1].to(dtype) for u in uses]) if len(uses) > 1 else uses[0][1].to(dtype)
            shape = param_shape(weight)  # ZeRO-3: the weight is released here
            flat_shape = (batch * shape[0], shape[1])
            if held is None:
                summed = self.buffers.empty(flat_shape, dtype, values.device).zero_().index_add_(0, ids, values)
            elif weight in self._owned and held.is_contiguous():  # in place: no copy of a (B, V, d) tensor
                summed = held.view(flat_shape).index_add_(0, ids, values)
            else:  # out of place: the held tensor may be referenced elsewhere
                summed = held.reshape(flat_shape).index_add(0, ids, values)
            self.grads[weight] = summed.view(batch, *shape)
            self._owned.add(weight)
        self._rows = {}

    def add(self, call: LayerCall, grads: Dict[nn.Parameter, torch.Tensor], fresh: bool = False) -> None:
        """Sum ``grads`` into the held per-sample gradients; ``fresh``: their memory is ours."""
        if not isinstance(grads, Mapping):
            raise PerSampleGradientError(
                f"the grad sampler of {call.name} ({type(call.module).__name__}) returned {type(grads).__name__}: a "
                "grad sampler must return a dict {parameter: per-sample gradient of shape (batch, *parameter.shape)} "
                "with an entry for each trainable parameter of the module (register_grad_sampler's contract)"
            )
        for name, param in call.params.items():
            grad = grads.get(param)
            if grad is None:
                raise PerSampleGradientError(
                    f"the grad sampler of {call.name} ({type(call.module).__name__}) returned no per-sample "
                    f"gradient for its trainable parameter {name!r}"
                )
            held = self.grads.get(param)
            if held is None:
                self.grads[param] = grad
                if fresh:
                    self._owned.add(param)
            elif held.shape != grad.shape:
                raise PerSampleGradientError(
                    f"parameter {self.name_of(param)} was used by calls with different batch sizes "
                    f"({held.shape[0]} and {grad.shape[0]}) in one backward pass; per-sample gradients need one "
                    "row per sample in every call"
                )
            elif param in self._owned and held.dtype == torch.promote_types(held.dtype, grad.dtype):
                held.add_(grad)
            else:
                self.grads[param] = held + grad
                self._owned.add(param)

    def finish_round(self, unit_ids: Optional[torch.Tensor]) -> None:
        self._sample_runs()
        self._place_rows()
        if unit_ids is not None:
            self.grads = {p: sum_rows_by_unit(g, unit_ids, self.name_of(p)) for p, g in self.grads.items()}

    def covers(self) -> set:
        self._sample_runs()
        return set(self.grads) | set(self._rows)

    def per_sample_norms(self) -> Dict[nn.Parameter, torch.Tensor]:
        self._sample_runs()

        def norms(stack: torch.Tensor) -> torch.Tensor:
            return torch.linalg.vector_norm(flatten_stacked(stack), dim=2, dtype=at_least_float32_dtype(stack.dtype))

        with torch.no_grad():
            return dict(zip(self.grads, stacked_map(norms, list(self.grads.values()))))

    def clipped_sums(self, factors: Dict[nn.Parameter, torch.Tensor], dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
        with torch.no_grad(), float32_matmuls_at_full_precision():
            self._sample_runs()
            params = [p for p in factors if p in self.grads]
            summed = weighted_sums([(factors[p].float(), zero_rows(self.grads[p], dropped)) for p in params])
            return {p: s.float() for p, s in zip(params, summed)}

    def batch_size(self) -> int:
        self._sample_runs()
        return next((g.shape[0] for g in self.grads.values()), next((r[0][2] for r in self._rows.values()), 0))


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
                if _plain_embedding(call) and list(shared.values()) == [call.module.weight]:
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
                squared = call.norm_sampler.norms_sq(call.module, call.activations, call.backprops)
                squares += [(param, squared[param], call.scale) for param in own]
            if len(own) < len(call.params):
                for param, form in call.norm_sampler.linear_form(call.module, call.activations, call.backprops).items():
                    if param in self._shared:
                        forms.setdefault(param, []).append((call.scale, form))
        for call, squared, grads in zip(affine_calls, *shared_affine_norms_and_grads(affine_uses)):
            squares += [(param, value, call.scale) for param, value in squared.items()]
            call.per_sample = grads or None
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
                use = _affine_use(call, wanted)
                if use is not None:  # Linear / Conv1D: the shared input scaled once per factor
                    # The factor stays float32 (a bf16 factor may round up past C / ||g_i||).
                    affine_uses.append(use if dropped is None else _without_units(use, dropped, zeroed_inputs))
                    affine_factors.append(tuple(
                        None if p is None else scaled_factor(p, call.scale) for p in (use.weight, use.bias)
                    ))
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


def zero_rows(x: torch.Tensor, dropped: Optional[torch.Tensor]) -> torch.Tensor:
    """``x`` with the rows of the ``dropped`` units (a bool mask over dim 0) exactly 0.

    By ``torch.where``, not by a factor of 0: an inf or NaN row times 0 is NaN, and in a matmul over
    the batch it would reach every unit's sum. ``dropped=None``: ``x`` itself.
    """
    if dropped is None:
        return x
    mask = dropped.to(x.device).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, x.new_zeros(()), x)


def _without_units(use: AffineUse, dropped: torch.Tensor, zeroed_inputs: Dict[object, torch.Tensor]) -> AffineUse:
    """``use`` with the dropped units' input and output-gradient rows zeroed; uses that read one input
    share its zeroed copy (``zeroed_inputs``, by memory), so they stay one group."""
    key = memory_key(use.inputs)
    if key not in zeroed_inputs:
        zeroed_inputs[key] = zero_rows(use.inputs, dropped)
    return dataclasses.replace(use, inputs=zeroed_inputs[key], backprops=zero_rows(use.backprops, dropped))


def _plain_embedding(call: LayerCall) -> bool:
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


def _affine_use(call: LayerCall, wanted) -> Optional[AffineUse]:
    """The call as an ``AffineUse`` of its wanted params, if its layer is a built-in Linear / Conv1D."""
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
    )


@contextlib.contextmanager
def float32_matmuls_at_full_precision() -> Iterator[None]:
    """Float32 matmuls in full float32 inside the block, whatever the user's TF32/bf16 setting.

    ``torch.backends.cuda.matmul.allow_tf32`` (the HF Trainer's ``tf32=True``) or
    ``torch.set_float32_matmul_precision("high"/"medium")`` let float32 matmuls round their inputs
    to 10 or 7 mantissa bits: a clipped contribution could then exceed ``C`` by up to about 0.4 %.
    Nothing is touched when the setting already is full precision; otherwise it is restored on
    exit (on torch >= 2.9 through the per-backend flags, which then read back as before through
    the legacy API too: torch refuses reads after a mix of the two APIs).
    """
    matmul_backends = [getattr(getattr(torch.backends, name, None), "matmul", None) for name in ("cuda", "mkldnn")]
    if all(hasattr(b, "fp32_precision") for b in matmul_backends):  # torch >= 2.9
        generic = torch.backends.fp32_precision
        before = [b.fp32_precision for b in matmul_backends]
        effective = [generic if value == "none" else value for value in before]
        if all(value in ("ieee", "none") for value in effective):
            yield
            return
        try:
            for backend in matmul_backends:
                backend.fp32_precision = "ieee"
            yield
        finally:
            for backend, value in zip(matmul_backends, before):
                backend.fp32_precision = value
        return
    before_precision = torch.get_float32_matmul_precision()
    if before_precision == "highest":
        yield
        return
    try:
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.set_float32_matmul_precision(before_precision)


def _root(squared: torch.Tensor) -> torch.Tensor:
    """Norms in float32 from squared norms (a rounded square may come out below 0)."""
    return squared.float().clamp(min=0).sqrt()


def _factors_cheaper(call: LayerCall) -> bool:
    """Cross terms cost about ``T^2 (d + p)`` per sample against ``T d p`` to instantiate; index
    (embedding) inputs make the factors cheap whatever ``T``."""
    inputs = call.activations[0] if call.activations else None
    if inputs is None or not inputs.is_floating_point():
        return True
    if call.units is not None:  # as in the (U, L) layout
        tokens = call.units.width * (math.prod(call.backprops.shape[2:-1]))
    else:
        tokens = math.prod(call.backprops.shape[1:-1]) if call.backprops.shape[0] else 0
    d, p = inputs.shape[-1], call.backprops.shape[-1]
    return tokens * (d + p) < d * p


def shared_norm(uses) -> torch.Tensor:
    """Certified per-sample norm of ``sum_k s_k G_k`` from each use's scale ``s_k`` and linear form
    ``G_k`` (cross terms included: ``linear_forms.shared_form_norms``)."""
    return shared_form_norms(uses)


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


def unit_index(unit_ids: torch.Tensor, rows: int, name: str = "") -> torch.Tensor:
    """Map arbitrary unit ids of ``rows`` rows to 0..U-1 in ascending id order."""
    if unit_ids.shape[0] != rows:
        raise PerSampleGradientError(
            f"privacy units name {unit_ids.shape[0]} rows but the batch of {name or 'a parameter'} has "
            f"{rows}; call set_privacy_units with one id per row of every batch"
        )
    return torch.unique(unit_ids, return_inverse=True)[1]


def sum_rows_by_unit(grad_sample: torch.Tensor, unit_ids: torch.Tensor, name: str = "") -> torch.Tensor:
    """Sum the rows of ``grad_sample`` that share a unit id; one row per unit, ids ascending."""
    units = unit_index(unit_ids.to(grad_sample.device), grad_sample.shape[0], name)
    num_units = int(units.max()) + 1 if units.numel() else 0
    return grad_sample.new_zeros((num_units, *grad_sample.shape[1:])).index_add_(0, units, grad_sample)


def group_rows_by_unit(x: torch.Tensor, unit_ids: torch.Tensor) -> torch.Tensor:
    """The rows of each unit placed side by side along the token dimension.

    Float tensors are ``(B, *middle, F)`` features and become ``(U, R * prod(middle), F)``;
    integer tensors (token ids) are ``(B, *rest)`` and become ``(U, R * prod(rest))``. Short units
    are padded with zeros, which add nothing to a token-wise layer's gradient (their backprops
    are zero).
    """
    units = unit_index(unit_ids.to(x.device), x.shape[0])
    num_units = int(units.max()) + 1 if units.numel() else 0
    counts = torch.bincount(units, minlength=num_units)
    width = int(counts.max()) if counts.numel() else 0
    order = torch.argsort(units, stable=True)
    sorted_units = units[order]
    position = torch.arange(len(units), device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_units]
    rows = x.reshape(x.shape[0], -1, x.shape[-1]) if x.is_floating_point() else x.reshape(x.shape[0], -1)
    grouped = rows.new_zeros((num_units, width, *rows.shape[1:]))
    grouped[sorted_units, position] = rows[order]
    return grouped.reshape(num_units, width * rows.shape[1], *rows.shape[2:])
