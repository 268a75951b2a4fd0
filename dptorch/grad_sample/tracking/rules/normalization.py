"""Normalisations and softmax: per-sample unless they normalise across the batch dim."""

from __future__ import annotations

from typing import Callable, Dict

from dptorch.grad_sample.tracking.args import arg, norm_dim
from dptorch.grad_sample.tracking.rules.structural import d_first, d_first_two, dim_is_batch, structural


def _d_group_norm(d, shape, args, kwargs, out):
    return d if d == 0 else "normalises across the batch dimension"


def _d_batch_norm(d, shape, args, kwargs, out):
    training = arg(args, kwargs, 5, "training", False)
    if training:
        return "batch normalisation in training mode (batch statistics mix the samples)"
    return d if d != 1 else "normalises across the batch dimension"


def _d_layer_norm(d, shape, args, kwargs, out):
    normalized = arg(args, kwargs, 1, "normalized_shape")
    count = 1 if isinstance(normalized, int) else len(normalized)
    return d if d < len(shape) - count else "normalises across the batch dimension"


def _d_softmax(d, shape, args, kwargs, out):
    dim = arg(args, kwargs, 1, "dim")
    if dim is None:
        dim = 0 if len(shape) in (0, 1, 3) else 1
    return "normalises across the batch dimension" if norm_dim(int(dim), len(shape)) == d else d


RULES: Dict[str, Callable] = {
    "softmax": structural(_d_softmax), "log_softmax": structural(_d_softmax), "softmin": structural(_d_softmax),
    "glu": structural(dim_is_batch(1, "dim", -1)), "normalize": structural(dim_is_batch(2, "dim", 1)),
    "gumbel_softmax": structural(dim_is_batch(4, "dim", -1)),
    "layer_norm": structural(_d_layer_norm), "rms_norm": structural(_d_layer_norm),
    "group_norm": structural(_d_group_norm), "batch_norm": structural(_d_batch_norm),
    "instance_norm": structural(d_first_two), "local_response_norm": structural(d_first),
}
