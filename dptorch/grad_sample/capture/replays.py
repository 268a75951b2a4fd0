"""The backward of a captured call of a layer with no grad sampler: replayed by the torch.func fallback
on the recorded call, per sample (``replay_backward``) or, in a packed forward, per token
(``token_replay``); or, where its one parameter is a weight read once by ``F.linear``, sampled as a
bias-free linear layer (``linear_head``)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch

from dptorch.grad_sample.capture.attachment import HookedLayer
from dptorch.grad_sample.capture.backward import CallBackward, not_per_sample, to_batch_first
from dptorch.grad_sample.capture.rounds import Rounds
from dptorch.grad_sample.capture.settings import Settings, Switches
from dptorch.grad_sample.modes.functorch import functorch_per_sample_grads
from dptorch.grad_sample.modes.linear_head import HEAD_NORM_SAMPLER, HEAD_SAMPLER, linear_head
from dptorch.grad_sample.modes.layer_call import LayerCall
from dptorch.grad_sample.tracking import INNER, CallBatch, origin_grads
from dptorch.grad_sample.units.token_tracker import TokenTracker
from dptorch.grad_sample.units.token_tracker import refuse as refused_for_tokens
from dptorch.grad_sample.units.token_units import TokenUnits


class Replays:
    """Replays recorded calls in backward and hands their per-sample gradients to the held round."""

    def __init__(self, settings: Settings, switches: Switches, rounds: Rounds, backward: CallBackward) -> None:
        self._settings, self._switches, self._rounds, self._backward = settings, switches, rounds, backward

    def replay_backward(self, layer: HookedLayer, params, call: CallBatch, call_leaves, call_spec, tensor_positions,
                        out_positions, saved, grad_outputs) -> None:
        if self._switches.suspended:
            return
        if call.kind == "batched" and self._linear_head_backward(layer, None, params, call, call_leaves, call_spec,
                                                                 tensor_positions, out_positions, saved, grad_outputs):
            return
        self._rounds.begin_round()
        leaves = _recorded_leaves(call_leaves, tensor_positions, saved)
        n = call.n
        positions, per_sample, out_dims = [], [], []
        for j, (pos, grad) in enumerate(zip(out_positions, grad_outputs)):
            if call.kind == "batched":
                dim = call.output_dims[j]
                if dim is None:  # an output without the batch: refused only if a gradient reached it
                    if grad is not None and bool((grad != 0).any()):
                        raise not_per_sample(layer, grad, n, None)
                    continue
                grad = to_batch_first(grad, dim, n)  # a batch merged with an inner dim: (n, rows, ...)
            elif call.kind == "origin":
                grad = origin_grads(call.origins[j], grad, rows_ok=False)[0]
            else:
                grad, dim = grad.expand(n, *grad.shape), None
            positions.append(pos)
            per_sample.append(self._settings.per_sample_scale(grad, n))
            out_dims.append(dim if call.kind == "batched" else None)
        if not positions:
            grads = {p: p.new_zeros((n, *p.shape)) for p in params.values()}
            self._rounds.strategy.add(LayerCall(layer.name, layer.module, params, None, None, (), grad_outputs[0]), grads)
            return
        tensor_dims = call.input_dims if call.kind == "batched" else (None,) * len(tensor_positions)
        with self._switches.replay(), torch.enable_grad():
            grads = functorch_per_sample_grads(
                layer.module, params, leaves, call_spec, positions, per_sample,
                batch_size=n, tensor_dims=tensor_dims, output_dims=out_dims,
            )
        self._rounds.strategy.add(LayerCall(layer.name, layer.module, params, None, None, (), per_sample[0]), grads)

    def token_replay(self, tokens: TokenTracker, layer: HookedLayer, inputs: Sequence[torch.Tensor],
                     outputs: Sequence[torch.Tensor]) -> Callable:
        """The backward of a packed forward's call of a layer with no grad sampler (an MoE router): replayed one
        token at a time by the torch.func fallback, each unit's gradient the sum of its tokens'. Only when the
        token tracker followed the call's own operations and found every input and output (flattened or not)
        keeping each token apart: then each output token depends on its input token and the parameters alone.
        A layer whose one parameter is a weight read once by ``F.linear`` on its input (``linear_head``) is
        sampled as a bias-free linear layer instead, from the gradient at the linear's output."""
        layouts = [tokens.layout(t) for t in (*inputs, *outputs)]
        if None in layouts:
            raise refused_for_tokens(
                f"{layer.name} ({type(layer.module).__name__}) has no grad sampler, and its inputs or outputs do not "
                "keep each packed token apart (the torch.func fallback replays such a layer one token at a time only "
                "when they all do)")
        return partial(self._token_replay_backward, layer, tokens.units, layouts[: len(inputs)], layouts[len(inputs):])

    def _token_replay_backward(self, layer: HookedLayer, units: TokenUnits, in_layouts, out_layouts, params,
                               call: CallBatch, call_leaves, call_spec, tensor_positions, out_positions, saved,
                               grad_outputs) -> None:
        if self._switches.suspended:
            return
        if self._linear_head_backward(layer, units, params, call, call_leaves, call_spec, tensor_positions,
                                      out_positions, saved, grad_outputs):
            return
        self._rounds.begin_round()
        self._rounds.enter_units(units)
        one_row_per_token = lambda t, layout: t if layout == "flat" else t.flatten(0, 1).unsqueeze(1)  # noqa: E731
        leaves = _recorded_leaves(call_leaves, tensor_positions,
                                  [one_row_per_token(t, layout) for t, layout in zip(saved, in_layouts)])
        scale = float(units.num_units) if self._settings.loss_reduction == "mean" else 1.0
        kept = [(pos, one_row_per_token(g, layout) * scale)
                for pos, g, layout in zip(out_positions, grad_outputs, out_layouts) if g is not None]
        tokens = units.index.to(saved[0].device if saved else units.index.device)
        with self._switches.replay(), torch.enable_grad():
            per_token = functorch_per_sample_grads(
                layer.module, params, leaves, call_spec, [pos for pos, _ in kept], [g for _, g in kept],
                batch_size=tokens.numel(), tensor_dims=(0,) * len(saved), output_dims=(0,) * len(kept),
            ) if kept else {p: p.new_zeros((tokens.numel(), *p.shape)) for p in params.values()}
        real = tokens >= 0
        grads = {p: g.new_zeros((units.num_units, *g.shape[1:])).index_add_(0, tokens[real], g[real])
                 for p, g in per_token.items()}
        self._rounds.strategy.add(LayerCall(layer.name, layer.module, params, None, None, (), next(iter(grads.values()))), grads)

    def _linear_head_backward(self, layer: HookedLayer, units: Optional[TokenUnits], params, call: CallBatch,
                              call_leaves, call_spec, tensor_positions, out_positions, saved, grad_outputs) -> bool:
        """The call of a layer with no grad sampler as a bias-free linear layer's (``linear_head``), on packed
        tokens (``units``) or on the batch's rows: False where it is not one (functorch mode: never), or where
        its rows are not laid out as the rules below read them."""
        if self._settings.grad_sample_mode == "functorch" or len(params) != 1:
            return False
        if units is None and any(call.output_dims[j] is None for j, g in enumerate(grad_outputs) if g is not None):
            return False  # an output without the batch that got a gradient: the replay refuses it
        grads = [(pos, g) for pos, g in zip(out_positions, grad_outputs) if g is not None]
        with self._switches.replay():
            head = linear_head(layer.module, next(iter(params.values())),
                               _recorded_leaves(call_leaves, tensor_positions, saved), call_spec, grads)
        if head is None:
            return False
        index, x, backprops = head
        if units is not None:
            rows, tokens = units.shape
            flat = x.dim() == 2 and x.shape[0] == rows * tokens
            if not flat and tuple(x.shape[:2]) != (rows, tokens):
                return False
        else:  # a row-major view of an input batched along dim 0: the batch merged with x's rows (k per sample)
            dim, n, flat = call.input_dims[index], call.n, False
            if dim is None or dim % INNER or n < 1 or x.dim() < 2 or x.shape[0] % n:
                return False
            k = x.shape[0] // n
            call = CallBatch("batched", n, (k * INNER if k > 1 else 0,), (k * INNER if k > 1 else 0,))
        norm_sampler = HEAD_NORM_SAMPLER if self._settings.grad_sample_mode in ("bk", "ghost") else None
        head_layer = HookedLayer(layer.name, layer.module, params, HEAD_SAMPLER, norm_sampler, True)
        self._backward.layer_backward(head_layer, params, call, units, flat, (x,), (backprops,))
        return True


def _recorded_leaves(call_leaves: Sequence[Any], tensor_positions: Sequence[int], tensors: Sequence[torch.Tensor]) -> list:
    """A recorded call's flattened arguments with its tensors (at ``tensor_positions``) replaced by ``tensors``."""
    leaves = list(call_leaves)
    for i, t in zip(tensor_positions, tensors):
        leaves[i] = t
    return leaves
