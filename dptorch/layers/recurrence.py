"""The recurrence of one recurrent layer in one direction, as pure functions.

Cells follow torch.nn's equations and gate order (RNN: one gate; GRU: r, z, n; LSTM: i, f, g,
o). ``sweep`` runs a cell over a batch-first sequence whose input projections ``gi = x W_ih^T +
b_ih`` were computed beforehand; ``sweep_backprops`` recomputes a sweep and returns, for every
step, the gradient of a loss with respect to the outputs of the three linear maps a step
applies (input, hidden-to-hidden, LSTM projection), paired with their inputs: what per-sample
gradients of the layer's weights are made of.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# cell(gi_t, gh_t, h_prev, extra_prev) -> (h_t before projection, extra_t); extra is () or (c,).
Cell = Callable[[Tensor, Tensor, Tensor, Tuple[Tensor, ...]], Tuple[Tensor, Tuple[Tensor, ...]]]


def tanh_cell(gi: Tensor, gh: Tensor, h: Tensor, extra: Tuple[Tensor, ...]) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """Elman cell: ``h' = tanh(gi + gh)``."""
    return torch.tanh(gi + gh), ()


def relu_cell(gi: Tensor, gh: Tensor, h: Tensor, extra: Tuple[Tensor, ...]) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """Elman cell with ReLU: ``h' = relu(gi + gh)``."""
    return torch.relu(gi + gh), ()


def gru_cell(gi: Tensor, gh: Tensor, h: Tensor, extra: Tuple[Tensor, ...]) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """GRU cell: ``n = tanh(gi_n + r * gh_n)``, ``h' = (1 - z) * n + z * h``."""
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * n + z * h, ()


def lstm_cell(gi: Tensor, gh: Tensor, h: Tensor, extra: Tuple[Tensor, ...]) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """LSTM cell: ``c' = f * c + i * g``, ``h' = o * tanh(c')`` (projected afterwards if ``proj_size``)."""
    (c,) = extra
    i, f, g, o = (gi + gh).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), (c,)


@dataclass(frozen=True)
class CellKind:
    """What distinguishes RNN, GRU and LSTM: gates per hidden unit, the step, a cell state."""

    gates: int
    step: Cell
    has_cell_state: bool = False


CELL_KINDS = {
    "RNN_TANH": CellKind(1, tanh_cell),
    "RNN_RELU": CellKind(1, relu_cell),
    "GRU": CellKind(3, gru_cell),
    "LSTM": CellKind(4, lstm_cell, has_cell_state=True),
}


@dataclass
class SweepTrace:
    """The per-step inputs and outputs of the hidden-to-hidden map and of the projection."""

    hidden_inputs: List[Tensor] = field(default_factory=list)
    hidden_outputs: List[Tensor] = field(default_factory=list)
    projection_inputs: List[Tensor] = field(default_factory=list)
    projection_outputs: List[Tensor] = field(default_factory=list)


def sweep(
    cell: Cell,
    gi: Tensor,
    h0: Tensor,
    extra0: Tuple[Tensor, ...],
    weight_hh: Tensor,
    bias_hh: Optional[Tensor],
    weight_hr: Optional[Tensor],
    mask: Optional[Tensor] = None,
    reverse: bool = False,
    trace: Optional[SweepTrace] = None,
) -> Tensor:
    """Run ``cell`` over the steps of ``gi`` (``(B, T, gates * H)``) from state ``(h0, *extra0)``.

    Returns ``(B, T, h_size + extra sizes)``: at position ``t``, the state after step ``t``
    (``h`` then the cell state). Where ``mask[b, t]`` is False the step is skipped and sample
    ``b`` keeps its state, so a padded sequence ends with the state of its last real step.
    ``reverse`` runs from the last position to the first.
    """
    steps = range(gi.shape[1] - 1, -1, -1) if reverse else range(gi.shape[1])
    h, extra = h0, extra0
    hs: List[Optional[Tensor]] = [None] * gi.shape[1]
    extras: List[List[Optional[Tensor]]] = [[None] * gi.shape[1] for _ in extra0]
    for t in steps:
        gh = F.linear(h, weight_hh, bias_hh)
        h_raw, new_extra = cell(gi[:, t], gh, h, extra)
        new_h = h_raw if weight_hr is None else F.linear(h_raw, weight_hr)
        if trace is not None:
            trace.hidden_inputs.append(h)
            trace.hidden_outputs.append(gh)
            trace.projection_inputs.append(h_raw)
            trace.projection_outputs.append(new_h)
        if mask is not None:
            keep = mask[:, t, None]
            new_h = torch.where(keep, new_h, h)
            new_extra = tuple(torch.where(keep, new, old) for new, old in zip(new_extra, extra))
        h, extra = new_h, new_extra
        hs[t] = h
        for column, value in zip(extras, extra):
            column[t] = value
    return torch.cat([torch.stack(hs, dim=1), *(torch.stack(column, dim=1) for column in extras)], dim=-1)


@dataclass
class SweepBackprops:
    """Each linear map of a sweep as (inputs, gradient w.r.t. outputs), all ``(B, T, features)``."""

    input_map: Tuple[Tensor, Tensor]
    hidden_map: Tuple[Tensor, Tensor]
    projection_map: Optional[Tuple[Tensor, Tensor]]


def sweep_backprops(
    cell: Cell,
    x: Tensor,
    h0: Tensor,
    extra0: Tuple[Tensor, ...],
    weight_ih: Tensor,
    bias_ih: Optional[Tensor],
    weight_hh: Tensor,
    bias_hh: Optional[Tensor],
    weight_hr: Optional[Tensor],
    mask: Optional[Tensor],
    reverse: bool,
    grad_states: Tensor,
) -> SweepBackprops:
    """Recompute a sweep and backpropagate ``grad_states`` (the gradient of its output) to each step.

    Samples never interact, so one batched backward pass gives every sample's own gradients.
    """
    with torch.enable_grad():
        gi = F.linear(x.detach(), weight_ih.detach(), _detached(bias_ih)).requires_grad_()
        h0 = h0.detach().requires_grad_()  # so that the first step's hidden map is in the graph
        trace = SweepTrace()
        states = sweep(
            cell, gi, h0, tuple(e.detach() for e in extra0), weight_hh.detach(), _detached(bias_hh),
            _detached(weight_hr), mask, reverse, trace,
        )
        targets = [gi, *trace.hidden_outputs]
        if weight_hr is not None:
            targets += trace.projection_outputs
        grads = torch.autograd.grad(states, targets, grad_states, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(targets, grads)]
    steps = len(trace.hidden_outputs)
    hidden_map = (_over_time(trace.hidden_inputs).detach(), _over_time(grads[1 : 1 + steps]))
    projection_map = None
    if weight_hr is not None:
        projection_map = (_over_time(trace.projection_inputs).detach(), _over_time(grads[1 + steps :]))
    return SweepBackprops((x.detach(), grads[0]), hidden_map, projection_map)


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


def _over_time(steps: List[Tensor]) -> Tensor:
    """Per-step ``(B, F)`` tensors as one ``(B, T, F)`` tensor (step order is irrelevant to sums over time)."""
    return torch.stack(steps, dim=1)
