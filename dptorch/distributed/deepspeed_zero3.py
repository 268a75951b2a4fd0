"""DeepSpeed ZeRO stage 3 under DP-SGD: each rank's partition of the noised gradient, written into ZeRO-3's buffer.

Under ZeRO-3 a parameter's ``data`` is empty outside the calls of its module (``param.ds_tensor`` holds
the rank's partition, ``param.ds_shape`` its shape), and ZeRO-3 reduce-scatters gradients into
partitions by its own gradient hooks. A private step instead:

* keeps the hooked layers' parameters out of autograd during their calls, as at stages 1 and 2 (no
  raw gradient; ZeRO-3's gradient hooks are removed while private, so a gradient by a path the
  controller refuses never enters its buckets); DeepSpeed's module hooks still gather the
  parameters for every forward and backward, so every rank runs every forward and backward (an
  empty Poisson micro-batch too);
* forms each unit's norm and the clipped sums from the captured activations and output gradients at
  the end of backward, and reduce-scatters them there into ZeRO-3's partition layout (``ceil(numel / world)``
  elements per rank, the last padded: one flat space per parameter, :mod:`dptorch.distributed.partitions`),
  in buckets, one layer's full-size sums at a time: each rank keeps only its part of the ranks' sum, added up
  over the backward passes of the logical step. Every rank does so after every backward pass (zeros for a pass
  that adds nothing: a phantom, an empty micro-batch), so the ranks meet in every reduce-scatter;
* at the step, adds the rank's slice of the step's noise to its partitions (``ShardedNoise``: every element
  drawn once, by the rank that owns it; no full-size noise anywhere), divides by the plan's divisor and
  writes each partition with DeepSpeed's own ``set_local_grad_for_param`` (what
  ``deepspeed.utils.safe_set_local_grad`` calls) into the buffer ZeRO-3 steps its fp32 master partition
  from. Nothing is averaged: the partition is the sum of the ranks' clipped sums plus noise, exactly.

Memory: between the micro-batches of a step each rank holds one fp32 partition (``1 / world`` of the
trainable parameters) of clipped sums; during the reduction at the end of a backward pass, one bucket
(at most ``partitions.BUCKET`` elements) and one layer's full-size clipped sums more. The price: one
reduce-scatter of the trainable parameters' size per backward pass instead of one per step.

The samplers run while the parameters are released (``data`` empty), so they must read no parameter
data, and a shape only from ``ds_shape`` (``param_shape``): the layers whose samplers read only their
activations, output gradients and the parameters' ``requires_grad``, dtype and such shapes are
accepted (``GradSampleHooks.reads_no_parameter_data``: Linear, Embedding, LayerNorm, the RMSNorms); another
trainable layer (or the torch.func fallback, which replays the call with the parameters, or expanded
weights) is refused before any step.

ZeRO-3's module hooks pass every module's inputs and outputs through two identity autograd Functions
(``module.pre_bwd_fn``, ``module.post_bwd_fn``: ``x.detach()`` forward, gradient unchanged) outside the
batch tracker's view; while private, each module's pair is wrapped so that its output carries its
input's batch tag (:func:`carry_batch_tags`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from dptorch.distributed.partitions import FlatSpace, keep_in_partitions, noised_partitions


#: What of ZeRO-3's optimizer (``DeepSpeedZeroOptimizer_Stage3``) the hand-over uses.
ZERO3_PARTS = ("fp16_groups", "set_local_grad_for_param", "independent_gradient_partition_epilogue",
               "_grad_acc_hooks", "create_reduce_and_remove_grad_hooks",
               "_get_param_partition_group", "_partition_all_parameters")


def engine_problems(zero: Any, world: int) -> List[str]:
    """What in a ZeRO-3 optimizer's set-up the partition hand-over cannot keep exact (empty: none)."""
    problems = []
    if getattr(zero, "leaf_parameters", None):
        problems.append("ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules, or "
                        '"stage3_module_granularity_threshold") reduce their parameters\' gradients in a module '
                        "backward hook of their own: unset them")
    groups = {torch.distributed.get_world_size(zero._get_param_partition_group(p))
              for p in trainable_params(zero)} if torch.distributed.is_initialized() else {1}
    if groups - {world}:
        problems.append(f"parameters partitioned over groups of {sorted(groups - {world})} of the {world} ranks: "
                        "dptorch hands ZeRO-3 partitions over all ranks (data parallelism only)")
    return problems


def layer_problems(hooks: Any) -> List[str]:
    """The controller's trainable layers that ZeRO-3's released parameters would make inexact (empty: none)."""
    if hooks.grad_sample_mode in ("functorch", "ew"):
        return [f'grad_sample_mode="{hooks.grad_sample_mode}" needs the parameters themselves in backward (the '
                "torch.func replay, expanded weights), which ZeRO-3 has released: use grad_sample_mode "
                '"hooks", "bk" or "ghost"']
    problems = []
    for layer in hooks._layers.values():
        if not any(p.requires_grad for p in layer.params.values()):
            continue
        if layer.sampler is None:
            problems.append(f"{layer.name} ({type(layer.module).__name__}) has no grad sampler: the torch.func "
                            "fallback replays its call with its parameters, which ZeRO-3 has released by then: "
                            f"register a grad sampler for {type(layer.module).__name__}, or freeze it")
        elif not hooks.reads_no_parameter_data(layer.module):
            problems.append(f"{layer.name} ({type(layer.module).__name__}): its sampler reads its parameters' shape "
                            "or values, which ZeRO-3 has released when the samplers run at the end of backward "
                            "(supported under ZeRO-3: nn.Linear, nn.Embedding, nn.LayerNorm, the RMSNorms): freeze it")
    return problems


#: DeepSpeed's autograd Functions that mark where a module's backward starts (on its outputs) and ends (on its
#: inputs): ``forward`` returns ``x.detach()``, ``backward`` returns the gradients unchanged.
_MARKERS = {"pre_bwd_fn": "PreBackwardFunctionForModule", "post_bwd_fn": "PostBackwardFunctionModule"}


class _TagCarrying:
    """Stands in for one of a module's marker Functions (``module.pre_bwd_fn``, ``module.post_bwd_fn``), which
    ZeRO-3's module hooks apply to every input and output, outside the batch tracker's view: the same Function,
    its output tagged as its input was (values and gradients pass unchanged, so the tag is exact)."""

    def __init__(self, function: Any, hooks: Any) -> None:
        self.function, self.hooks = function, hooks

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        out = self.function.apply(tensor)
        for tracker in (self.hooks._tracker, getattr(self.hooks, "_token_tracker", None)):
            if tracker is not None and out is not tensor and tracker.get(out) is None:
                tracker.put(out, tracker.get(tensor))
        return out


def carry_batch_tags(model: nn.Module, hooks: Any) -> Dict[nn.Module, Dict[str, Any]]:
    """Make ZeRO-3's marker Functions on every module of ``model`` carry the batch tracker's tags; returns the
    originals (:func:`restore_markers`). Refused when a marker is not the Function it is known to be."""
    saved: Dict[nn.Module, Dict[str, Any]] = {}
    for module in model.modules():
        for attribute, expected in _MARKERS.items():
            function = module.__dict__.get(attribute)
            if function is None:
                continue
            if getattr(function, "__name__", None) != expected:
                restore_markers(saved)
                raise ValueError(f"ZeRO-3's {attribute} on {type(module).__name__} is {function!r}, not DeepSpeed's "
                                 f"{expected} (tested with deepspeed 0.19.8), whose outputs dptorch knows to be its "
                                 "inputs: install that version")
            saved.setdefault(module, {})[attribute] = function
            setattr(module, attribute, _TagCarrying(function, hooks))
    return saved


def restore_markers(saved: Dict[nn.Module, Dict[str, Any]]) -> None:
    for module, functions in saved.items():
        for attribute, function in functions.items():
            setattr(module, attribute, function)


def attach(engine: Any, dp_optimizer: Any) -> Dict[nn.Module, Dict[str, Any]]:
    """Make a ZeRO-3 engine's DP optimizer write the noised partitions, and the marker Functions carry the batch
    tags; returns the markers to restore (the model and noise were checked: ``layer_problems``)."""
    markers = carry_batch_tags(engine.module, dp_optimizer.hooks)
    dp_optimizer.use_gradient_writer(Zero3Partitions(engine.optimizer))  # whole-parameter writing reads p.shape: empty
    return markers


class Zero3Partitions:
    """The DP optimizer's gradient writer (``dptorch.optim.gradient_writer``) under ZeRO-3: one flat space per
    trainable parameter (``dptorch.distributed.partitions``), ``ceil(numel / world)`` elements per rank, the last
    rank's padded; at the end of every backward pass the clipped sums are reduce-scattered into this rank's parts,
    so a step over several micro-batches holds partition-sized sums only; the step writes each rank's partition
    of the noised gradient into ZeRO-3's buffer with ``set_local_grad_for_param``."""

    def __init__(self, zero: Any) -> None:
        self.zero = zero

    def keep(self, optimizer: Any, hooks: Any, factors: Dict[nn.Parameter, torch.Tensor],
             dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
        keep_in_partitions(optimizer, hooks, factors, dropped, parameter_spaces(optimizer.params))
        return {}

    def write(self, optimizer: Any, params: List[nn.Parameter]) -> None:
        spaces = parameter_spaces(optimizer.params)
        for space, part in zip(spaces, noised_partitions(optimizer, spaces)):
            self.zero.set_local_grad_for_param(part, space.params[0])


def parameter_spaces(params: List[nn.Parameter]) -> List[FlatSpace]:
    """ZeRO-3's layout: each parameter its own flat space of ``partition_numel()`` elements per rank."""
    return [FlatSpace(size=int(p.partition_numel()), params=(p,), offsets=(0,), numels=(int(p.ds_numel),),
                      device=p.ds_tensor.device) for p in params]


def trainable_params(zero: Any) -> List[nn.Parameter]:
    """The parameters ZeRO-3 steps, in its order (the noise stream's parameter index; the client optimizer's
    order, as in one process)."""
    return [p for group in zero.fp16_groups for p in group if p.requires_grad]


__all__ = ["ZERO3_PARTS", "Zero3Partitions", "attach", "carry_batch_tags", "engine_problems", "layer_problems",
           "parameter_spaces", "restore_markers", "trainable_params"]
