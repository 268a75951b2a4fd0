"""Strategies: what the controller keeps of each layer call, and how it answers the optimizer.

Every strategy answers the same two questions (the seam of the design): each parameter's
per-sample gradient norms, and ``sum_i c_i g_i`` for given clip factors ``c``.

- ``Instantiate`` (modes "hooks", "functorch"): per-sample gradients are built in backward.
- ``BookKeeping`` (mode "bk"): keeps each call's activations and output gradients, computes
  norms from them (ghost or instantiated, per layer) and the clipped sums directly: one backward.
- ``BookKeeping(second_pass=...)`` (mode "ghost"): the same norms, the clipped sums from a second
  backward pass of the per-sample loss reweighted by the clip factors (Opacus' ghost clipping).

Layers without a norm sampler, and parameters used by several calls (tied weights), are
instantiated inside the book-keeping strategies too: the norm of a shared parameter is the norm
of the sum of its uses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.ghost import form_inner_products
from dptorch.grad_sample.registry import GradSampler, NormSampler

NameOf = Callable[[nn.Parameter], str]


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

    def scaled_backprops(self) -> torch.Tensor:
        return self.backprops * self.scale if self.scale != 1.0 else self.backprops


class Instantiate:
    """Per-sample gradients, summed over the calls of one backward round."""

    def __init__(self, name_of: NameOf) -> None:
        self.name_of = name_of
        self.grads: Dict[nn.Parameter, torch.Tensor] = {}

    def on_call(self, call: LayerCall) -> None:
        self.add(call, call.sampler(call.module, call.activations, call.scaled_backprops()))

    def add(self, call: LayerCall, grads: Dict[nn.Parameter, torch.Tensor]) -> None:
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
            elif held.shape != grad.shape:
                raise PerSampleGradientError(
                    f"parameter {self.name_of(param)} was used by calls with different batch sizes "
                    f"({held.shape[0]} and {grad.shape[0]}) in one backward pass; per-sample gradients need one "
                    "row per sample in every call"
                )
            else:
                self.grads[param] = held + grad

    def finish_round(self, unit_ids: Optional[torch.Tensor]) -> None:
        if unit_ids is not None:
            self.grads = {p: sum_rows_by_unit(g, unit_ids, self.name_of(p)) for p, g in self.grads.items()}

    def covers(self) -> set:
        return set(self.grads)

    def per_sample_norms(self) -> Dict[nn.Parameter, torch.Tensor]:
        return {p: torch.linalg.vector_norm(g.flatten(1), dim=1, dtype=torch.float32) for p, g in self.grads.items()}

    def clipped_sums(self, factors: Dict[nn.Parameter, torch.Tensor]) -> Dict[nn.Parameter, torch.Tensor]:
        return {p: torch.einsum("i,i...->...", c, self.grads[p].float()) for p, c in factors.items() if p in self.grads}

    def batch_size(self) -> int:
        return next((g.shape[0] for g in self.grads.values()), 0)


class BookKeeping:
    """Norms from kept (activations, backprops); clipped sums from them or from a second pass."""

    def __init__(self, name_of: NameOf, second_pass: Optional[Callable[[], ContextManager]] = None) -> None:
        self.name_of = name_of
        self.dense = Instantiate(name_of)
        self.calls: List[LayerCall] = []
        self.second_pass = second_pass  # a context that suspends capture; None for book-keeping
        self.per_sample_loss: Optional[torch.Tensor] = None
        self._norms: Optional[Dict[nn.Parameter, torch.Tensor]] = None
        self._row_units: Optional[torch.Tensor] = None
        self._shared: set = set()

    @property
    def grads(self) -> Dict[nn.Parameter, torch.Tensor]:
        return self.dense.grads

    def on_call(self, call: LayerCall) -> None:
        if call.norm_sampler is None:
            self.dense.on_call(call)
        else:
            self.calls.append(call)

    def add(self, call: LayerCall, grads: Dict[nn.Parameter, torch.Tensor]) -> None:
        self.dense.add(call, grads)

    def finish_round(self, unit_ids: Optional[torch.Tensor]) -> None:
        uses = Counter(p for call in self.calls for p in call.params.values())
        uses.update(self.dense.grads.keys())
        factored = self._factored_shared_params(uses, unit_ids)
        kept = []
        for call in self.calls:
            shared = {n: p for n, p in call.params.items() if uses[p] > 1 and p not in factored}
            if unit_ids is not None and not call.norm_sampler.token_wise:
                shared = call.params
            if shared:
                grads = call.sampler(call.module, call.activations, call.scaled_backprops())
                self.dense.add(LayerCall(call.name, call.module, shared, None, None, (), call.backprops), grads)
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
        if unit_ids is not None and self.second_pass is not None:
            self._row_units = unit_index(unit_ids, len(unit_ids))
        self._norms = None

    def _factored_shared_params(self, uses: Counter, unit_ids: Optional[torch.Tensor]) -> set:
        """Shared parameters whose every use has a linear form: their norm comes from the factors."""
        candidates = {p for p, count in uses.items() if count > 1 and p not in self.dense.grads}
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
            norms = self.dense.per_sample_norms()
            forms: Dict[nn.Parameter, list] = {}
            for call in self.calls:
                own = [p for p in call.params.values() if p not in self._shared]
                if own:
                    squared = call.norm_sampler.norms_sq(call.module, call.activations, call.backprops)
                    for param in own:
                        norms[param] = squared[param].clamp(min=0).sqrt() * call.scale
                if len(own) < len(call.params):
                    for param, form in call.norm_sampler.linear_form(call.module, call.activations, call.backprops).items():
                        if param in self._shared:
                            forms.setdefault(param, []).append((call.scale, form))
            for param, uses in forms.items():
                norms[param] = shared_norm(uses)
            self._norms = norms
        return self._norms

    def clipped_sums(self, factors: Dict[nn.Parameter, torch.Tensor]) -> Dict[nn.Parameter, torch.Tensor]:
        sums = self.dense.clipped_sums(factors)
        if self.second_pass is not None:
            sums.update(self._second_pass_sums(factors))
            return sums
        for call in self.calls:
            for factor, params in _group_by_factor(call.params.values(), factors):
                scale = (factor * call.scale).to(call.backprops.dtype).view(-1, *([1] * (call.backprops.dim() - 1)))
                computed = call.norm_sampler.clipped_sum(call.module, call.activations, call.backprops * scale)
                for param in params:
                    sums[param] = computed[param] + sums[param] if param in sums else computed[param]
        return sums

    def _second_pass_sums(self, factors: Dict[nn.Parameter, torch.Tensor]) -> Dict[nn.Parameter, torch.Tensor]:
        params = list(dict.fromkeys(p for call in self.calls for p in call.params.values() if p in factors))
        if not params:
            return {}
        if self.per_sample_loss is None:
            raise PerSampleGradientError(
                "grad_sample_mode='ghost' computes the clipped gradient in a second backward pass of the per-sample "
                "loss: wrap the criterion with dptorch.DPLoss (loss = criterion(output, target); loss.backward()), or "
                "use grad_sample_mode='bk', which needs no wrapper"
            )
        factor = factors[params[0]]
        if any(factors[p] is not factor for p in params):
            raise ValueError("grad_sample_mode='ghost' supports flat clipping only; use 'bk' or 'hooks' for per-layer clipping")
        if self._row_units is not None:
            factor = factor[self._row_units.to(factor.device)]  # one factor per unit, applied to its rows
        with self.second_pass(), torch.enable_grad():
            reweighted = (factor.to(self.per_sample_loss.dtype) * self.per_sample_loss).sum()
            grads = torch.autograd.grad(reweighted, params, allow_unused=True)
        return {p: (torch.zeros_like(p, dtype=torch.float32) if g is None else g.float()) for p, g in zip(params, grads)}

    def batch_size(self) -> int:
        if self.calls:
            return self.calls[0].backprops.shape[0]
        return self.dense.batch_size()


def _factors_cheaper(call: LayerCall) -> bool:
    """Cross terms cost about ``T^2 (d + p)`` per sample against ``T d p`` to instantiate; index
    (embedding) inputs make the factors cheap whatever ``T``."""
    inputs = call.activations[0] if call.activations else None
    if inputs is None or not inputs.is_floating_point():
        return True
    tokens = call.backprops[0].numel() // call.backprops.shape[-1] if call.backprops.shape[0] else 0
    d, p = inputs.shape[-1], call.backprops.shape[-1]
    return tokens * (d + p) < d * p


def shared_norm(uses) -> torch.Tensor:
    """Per-sample norm of ``sum_k s_k G_k`` from each use's scale ``s_k`` and linear form ``G_k``."""
    total = None
    for k, (scale_k, form_k) in enumerate(uses):
        for scale_l, form_l in uses[k:]:
            weight = scale_k * scale_l * (1.0 if form_l is form_k else 2.0)
            term = weight * form_inner_products(form_k, form_l)
            total = term if total is None else total + term
    return total.clamp(min=0).sqrt()


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
