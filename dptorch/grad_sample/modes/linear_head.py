"""Layers whose one parameter is a weight read once by ``F.linear`` on their input (an MoE router).

A mixture-of-experts router computes ``logits = F.linear(x, W)`` and then, without parameters, its
scores and choices (softmax, top-k, renormalisation). Its weight's gradient is a linear layer's:
``sum_t G_t x_t^T`` with ``G_t`` the gradient at the logits. ``linear_head`` recomputes the call's
forward once, with the logits as a leaf, to find ``G`` for every token at once; the layer's per-unit
norms and clipped sums are then those of a bias-free linear layer (``HEAD_SAMPLER``,
``HEAD_NORM_SAMPLER``), on ``(tokens, d)`` rows instead of a per-token replay's ``(tokens, out, d)``.

It applies only where it is exact: the forward reads the weight nowhere but in that one ``F.linear``,
draws no random numbers (no random operation by name, no ``torch.Generator`` argument, the default
generators' states unchanged: a recomputation could not redraw the forward's), and the linear's input is the call's input itself, or a row-major view of it
(``x.view(-1, d)``), so that its rows are the input's rows (samples' or tokens') in order. That each
sample's (or packed token's) outputs depend on its own logits rows alone is the batch (or token)
tracker's finding in the forward, as for the torch.func replay it replaces (``hooks``).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptorch.grad_sample.layers.linear import linear_map_grad_samples, linear_norms, linear_sums
from dptorch.grad_sample.norms.linear_forms import LinearForm, flatten_middle_dims
from dptorch.grad_sample.layers.registry import NormSampler

Tensors = Tuple[torch.Tensor, ...]
_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "exponential", "cauchy", "geometric")


class _LinearReads(TorchFunctionMode):
    """Replaces ``F.linear(x, weight)`` by a leaf computed from detached factors; notes any other read of
    ``weight`` and any random operation."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.calls: list = []  # (x, leaf) per F.linear of the weight
        self.other = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        reads = any(t is self.weight for t in leaves)
        if reads and func is F.linear and len(args) == 2 and not kwargs and args[1] is self.weight:
            x = args[0]
            leaf = func(x.detach(), self.weight.detach()).requires_grad_()
            self.calls.append((x, leaf))
            return leaf
        name = getattr(func, "__name__", "")
        if reads or any(word in name for word in _RANDOM) or any(isinstance(t, torch.Generator) for t in leaves):
            self.other = True
        return func(*args, **kwargs)


def _rng_states(device: torch.device) -> list:
    """The default generators' states a random operation on ``device`` (or the CPU) would advance."""
    states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


#: modules a recomputation found not to be such a head: replayed by the torch.func fallback from then on
#: (exact whatever the reason), without recomputing their forward again first
_DECLINED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _row_aligned(x: torch.Tensor, inputs: Sequence[torch.Tensor]) -> Optional[int]:
    """The index of the input ``x`` is, or is a row-major view of (same memory, both contiguous); None."""
    return next((i for i, t in enumerate(inputs) if x is t or (
        x.data_ptr() == t.data_ptr() and x.numel() == t.numel() and x.is_contiguous() and t.is_contiguous()
        and x.dtype == t.dtype)), None)


def linear_head(module: nn.Module, weight: torch.Tensor, call_leaves: list, call_spec: Any,
                grads: Sequence[Tuple[int, torch.Tensor]]) -> Optional[Tuple[int, torch.Tensor, torch.Tensor]]:
    """``(i, x, G)``: the linear's input ``x`` (a row-major view of the call's ``i``-th tensor argument) and the
    gradient at its output, for the recorded call whose output leaves at the positions of ``grads`` received
    those gradients; None where the call is not such a head."""
    if weight.dim() != 2 or module in _DECLINED:
        return None
    args, kwargs = tree_unflatten(list(call_leaves), call_spec)
    inputs = [t for t in call_leaves if isinstance(t, torch.Tensor)]
    reads = _LinearReads(weight)
    before = _rng_states(weight.device)
    with torch.enable_grad():  # backward runs without grad mode
        with reads:
            out_leaves, _ = tree_flatten(module.forward(*args, **kwargs))
        drew = any(not torch.equal(a, b) for a, b in zip(before, _rng_states(weight.device)))
        one_read = len(reads.calls) == 1 and not reads.other and not drew
        index = _row_aligned(reads.calls[0][0], inputs) if one_read else None
        if index is None:
            _DECLINED.add(module)
            return None
        x, leaf = reads.calls[0]
        total = sum((out_leaves[pos] * g).sum() for pos, g in grads if out_leaves[pos].requires_grad)
        if not isinstance(total, torch.Tensor):
            return index, x.detach(), torch.zeros_like(leaf)
        (backprops,) = torch.autograd.grad(total, leaf, allow_unused=True)
    return index, x.detach(), torch.zeros_like(leaf) if backprops is None else backprops


def _head_grad_sampler(module: nn.Module, activations: Tensors, backprops: torch.Tensor, empty=None, scale=1.0):
    return linear_map_grad_samples(module.weight, None, activations[0], backprops, empty=empty, scale=scale)


def _head_norms(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    return linear_norms(module.weight, None, activations[0], backprops)


def _head_sums(module: nn.Module, activations: Tensors, scaled_backprops: torch.Tensor):
    return linear_sums(module.weight, None, activations[0], scaled_backprops)


def _head_form(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, LinearForm]:
    return {module.weight: LinearForm(flatten_middle_dims(backprops), flatten_middle_dims(activations[0]))}


HEAD_SAMPLER = _head_grad_sampler
HEAD_NORM_SAMPLER = NormSampler(_head_norms, _head_sums, True, _head_form)
