"""``Instantiate`` (modes "hooks", "functorch", "ew"): per-sample gradients built in backward.

Like ``BookKeeping`` (``book_keeping.py``), it answers the two questions the optimizer asks: each
parameter's per-sample gradient norms, and ``sum_i c_i g_i`` for given clip factors ``c``. The
per-sample gradients of a parameter's calls in one backward round are summed. ``nn.Embedding``
calls are kept as rows until the round ends and added into the weight's other per-sample gradient (a
tied output head) instead of a dense ``(B, V, d)`` of their own, in place when that gradient is
memory it owns (``FRESH_RESULT_SAMPLERS``). Small calls of one layer configuration are sampled
together (``stacked_calls.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.layers.embedding import embedding_rows
from dptorch.grad_sample.layers.linear import param_shape
from dptorch.grad_sample.modes.buffers import BufferPool
from dptorch.grad_sample.modes.layer_call import LayerCall, plain_embedding, sampled_grads
from dptorch.grad_sample.modes.precision import float32_matmuls_at_full_precision
from dptorch.grad_sample.modes.stacked_calls import fits, merged, split, stack_key
from dptorch.grad_sample.modes.unit_rows import sum_rows_by_unit, zero_rows
from dptorch.grad_sample.norms.linear_forms import at_least_float32_dtype, flatten_stacked, stacked_map, weighted_sums

NameOf = Callable[[nn.Parameter], str]


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
        if plain_embedding(call):
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
