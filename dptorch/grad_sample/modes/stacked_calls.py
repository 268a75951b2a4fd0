"""Small calls of one layer configuration sampled as one call: the norms of a narrow model's blocks.

At small shapes a backward pass's time is its number of torch calls, not their arithmetic, and a
model's blocks repeat the same layers: twelve LayerNorms of one width, each sampled on its own, issue
twelve times the calls of one. Calls of one *configuration* (the layer's class, its plain attributes
such as ``eps`` and ``normalized_shape``, its trainable parameters' names, shapes and dtypes, the
sampler, the inputs' and output gradient's shapes and dtypes, the scale) are concatenated along the
batch and sampled once by the first call's module; each call then takes its own rows.

That is exact only for samplers that work row by row and read no parameter data (their results
depend on the module's configuration, never on its weights): the built-in samplers of
``layers.samples_from_shapes_alone``, never one the user registered. Any other call, a packed one, an empty batch or a large one is
sampled alone, at once; a run is sampled when it would hold more than ``STACK_LIMIT`` elements, so
what waits is bounded by the model's number of configurations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from dptorch.grad_sample.layers import samples_from_shapes_alone
from dptorch.grad_sample.norms.linear_forms import STACK_LIMIT


def stack_key(call: Any) -> Optional[tuple]:
    """The configuration calls must share to be sampled together, or None when ``call`` goes alone."""
    module = call.module
    if call.units is not None or not samples_from_shapes_alone(call.sampler):
        return None
    if not call.backprops.dim() or call.backprops.shape[0] == 0:
        return None
    if any(not isinstance(t, torch.Tensor) for t in call.activations) or 2 * call_size(call) > STACK_LIMIT:
        return None
    config = tuple(sorted((k, v) for k, v in vars(module).items() if not k.startswith("_")))
    try:
        hash(config)
    except TypeError:  # an attribute that is not a plain value: the configuration cannot be compared
        return None
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in call.params.items())
    tensors = tuple((tuple(t.shape), t.dtype, t.device) for t in (*call.activations, call.backprops))
    return (type(module), config, params, call.sampler, tensors, call.scale)


def call_size(call: Any) -> int:
    """Elements of a call's inputs and output gradient (what a run of calls holds until it is sampled)."""
    return sum(t.numel() for t in call.activations) + call.backprops.numel()


def fits(run: List[Any], call: Any) -> bool:
    """Whether ``call`` may join ``run`` (of its configuration) within ``STACK_LIMIT``."""
    return not run or (len(run) + 1) * call_size(call) <= STACK_LIMIT


def merged(run: List[Any]) -> Any:
    """One call standing for the ``run``: the first call's module, the run's rows concatenated."""
    first = run[0]
    activations = tuple(torch.cat(parts) for parts in zip(*(call.activations for call in run)))
    return dataclasses.replace(first, activations=activations, backprops=torch.cat([call.backprops for call in run]))


def split(run: List[Any], grads: Dict[nn.Parameter, torch.Tensor]) -> List[Dict[nn.Parameter, torch.Tensor]]:
    """Each call's own rows of the merged call's per-sample gradients (keyed by the first call's
    parameters), keyed by its own parameters of the same names."""
    first = run[0]
    pieces = {name: grads[p].chunk(len(run)) for name, p in first.params.items() if p in grads}
    return [{call.params[name]: parts[j] for name, parts in pieces.items()} for j, call in enumerate(run)]
