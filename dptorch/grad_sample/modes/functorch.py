"""torch.func fallback: per-sample gradients of any module's *direct* parameters.

Replays one recorded call of the module under ``vmap(grad(...))``, one sample at a time, with
the sample's output gradient as the cotangent. Children keep their own weights (only direct
parameters are differentiated), keyword arguments are replayed, and arguments that do not carry
the batch (shared masks, broadcast tensors; the controller's batch tracking says which) are passed
unbatched. The module's own hooks do not run in the replay; its children's do (the controller
ignores them while replaying).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.func import grad, vmap
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tracking.tags import INNER


def functorch_per_sample_grads(
    module: nn.Module,
    params: Dict[str, nn.Parameter],
    call_leaves: List[Any],
    call_spec: Any,
    output_positions: Sequence[int],
    grad_outputs: Sequence[torch.Tensor],
    *,
    batch_size: int,
    tensor_dims: Sequence[Optional[int]],
    output_dims: Sequence[Optional[int]],
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients (batch first) of ``params`` for one recorded call of ``module``.

    ``call_leaves``/``call_spec`` are the pytree-flattened ``(args, kwargs)`` of the call; its
    tensor leaves carry the batch along ``tensor_dims`` (None: shared by the samples).
    ``output_positions`` index the output's flattened leaves that ``grad_outputs`` belong to; each
    gradient has the batch first, and its output carries the batch along ``output_dims`` (None:
    an output shared by the samples, whose per-sample gradient has the output's full shape).
    """
    if batch_size == 0:
        return {p: p.new_zeros((0, *p.shape)) for p in params.values()}
    names = list(params)
    tensor_positions = [i for i, leaf in enumerate(call_leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [call_leaves[i] for i in tensor_positions]
    # a batch merged with an inner dim of k rows per sample (``d + k * INNER``): each sample's k rows
    # are replayed together, in the place of the merged dim
    merged = tuple(d is not None and d >= INNER for d in tensor_dims)
    tensors = [t.unflatten(d % INNER, (batch_size, d // INNER)) if m else t for t, d, m in zip(tensors, tensor_dims, merged)]
    tensor_dims = tuple(None if d is None else d % INNER for d in tensor_dims)
    out_merged = tuple(d is not None and d >= INNER for d in output_dims)
    output_dims = tuple(None if d is None else d % INNER for d in output_dims)

    def sample_loss(param_values, sample_tensors, sample_grads):
        leaves = list(call_leaves)
        for pos, t, dim, m in zip(tensor_positions, sample_tensors, tensor_dims, merged):
            leaves[pos] = t if dim is None or m else t.unsqueeze(dim)
        args, kwargs = tree_unflatten(leaves, call_spec)
        # module.forward, not module(): the module's own forward hooks ran before the capture point
        # (or after it) in the real call, and must not run twice here.
        with _reparametrize_module(module, dict(zip(names, param_values))):
            out_leaves, _ = tree_flatten(module.forward(*args, **kwargs))
        total = 0
        for pos, g, dim, m in zip(output_positions, sample_grads, output_dims, out_merged):
            target = g if dim is None or m else g.unsqueeze(dim)
            if out_leaves[pos].shape != target.shape:  # broadcasting would sum copies of the sample silently
                raise PerSampleGradientError(_shape_mismatch(module, out_leaves[pos].shape, target.shape))
            total = total + (out_leaves[pos] * target).sum()
        return total

    per_sample = vmap(grad(sample_loss), in_dims=(None, tensor_dims, 0))
    values = tuple(p.detach() for p in params.values())
    try:
        grads = per_sample(values, tuple(tensors), tuple(grad_outputs))
    except PerSampleGradientError:
        raise
    except RuntimeError as err:
        raise PerSampleGradientError(_explain(module, err)) from err
    return dict(zip(params.values(), grads))


def _explain(module: nn.Module, err: RuntimeError) -> str:
    cause = str(err).splitlines()[0]
    if "random" in cause:
        cause = "its forward uses random operations (e.g. dropout), which cannot be replayed per sample"
    return (
        f"cannot compute per-sample gradients of {type(module).__name__} with the torch.func fallback: "
        f"{cause}. Register an exact sampler with @dptorch.grad_sample.register_grad_sampler"
        f"({type(module).__name__}), move the offending operation into a child module, or freeze its parameters."
    )


def _shape_mismatch(module: nn.Module, got: torch.Size, want: torch.Size) -> str:
    return (
        f"{type(module).__name__}, replayed for one sample by the torch.func fallback, returns an output of shape "
        f"{tuple(got)} instead of the sample's {tuple(want)}: an argument it takes as shared by the samples has the "
        "batch's rows (a mask built from the batch's shape, such as torch.ones(input_shape) when the model gets no "
        "attention_mask), so the replay would count the sample once per row. Pass the model the argument it builds "
        "(e.g. attention_mask), so that it carries the batch, or freeze the module's direct parameters."
    )
