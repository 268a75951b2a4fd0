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
  elements per rank, the last padded), in buckets, one layer's full-size sums at a time: each rank keeps
  only its partition of the ranks' sum, added up over the backward passes of the logical step. Every rank
  does so after every backward pass (zeros for a pass that adds nothing: a phantom, an empty micro-batch),
  so the ranks meet in every reduce-scatter;
* at the step, adds the rank's slice of the step's noise to its partitions (``ShardedNoise``: every element
  drawn once, by the rank that owns it; no full-size noise anywhere), divides by the plan's divisor and
  writes each partition with DeepSpeed's own ``set_local_grad_for_param`` (what
  ``deepspeed.utils.safe_set_local_grad`` calls) into the buffer ZeRO-3 steps its fp32 master partition
  from. Nothing is averaged: the partition is the sum of the ranks' clipped sums plus noise, exactly.

Memory: between the micro-batches of a step each rank holds one fp32 partition (``1 / world`` of the
trainable parameters) of clipped sums; during the reduction at the end of a backward pass, one bucket
(at most :data:`BUCKET` elements) and one layer's full-size clipped sums more. The price: one
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

import itertools
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from dptorch.distributed.fsdp import groups_by_module, sharded_noise


#: What of ZeRO-3's optimizer (``DeepSpeedZeroOptimizer_Stage3``) the hand-over uses.
ZERO3_PARTS = ("fp16_groups", "set_local_grad_for_param", "independent_gradient_partition_epilogue",
               "_grad_acc_hooks", "create_reduce_and_remove_grad_hooks", "_get_param_partition_rank",
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


def noise_problems(optimizer: Any) -> List[str]:
    """What of the DP optimizer's noise the partition hand-over does not draw (empty: none)."""
    if getattr(optimizer.plan, "strategy", None) is not None:
        return ["noise_mechanism='bandmf' keeps its correlated noise state for whole parameters, while under ZeRO-3 "
                "each rank draws only its partition's noise: use noise_mechanism='independent'"]
    return []


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
    tags; returns the markers to restore. A model or noise the hand-over cannot keep exact is refused first, the
    controller and the optimizer's listener removed (the model is as it was)."""
    problems = layer_problems(dp_optimizer.hooks) + noise_problems(dp_optimizer)
    if problems:
        dp_optimizer.detach()
        dp_optimizer.hooks.cleanup()
        raise ValueError("private training under DeepSpeed ZeRO-3 refuses this model: " + "; ".join(problems)
                         + ". Or use ZeRO stage 1 or 2, which keep whole parameters on every rank")
    markers = carry_batch_tags(engine.module, dp_optimizer.hooks)
    dp_optimizer.use_gradient_writer(Zero3Partitions(engine.optimizer))  # whole-parameter writing reads p.shape: empty
    return markers


class Zero3Partitions:
    """The DP optimizer's gradient writer (``dptorch.optim.gradient_writer``) under ZeRO-3: at the end of every
    backward pass the clipped sums are reduce-scattered into this rank's partitions (:func:`keep_partitions`), so
    a step over several micro-batches holds partition-sized sums only; the step writes each rank's partition of
    the noised gradient into ZeRO-3's buffer (:func:`write_noised_partitions`)."""

    def __init__(self, zero: Any) -> None:
        self.zero = zero

    def keep(self, optimizer: Any, hooks: Any, factors: Dict[nn.Parameter, torch.Tensor],
             dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
        keep_partitions(optimizer, hooks, factors, dropped)
        return {}

    def write(self, optimizer: Any, params: List[nn.Parameter]) -> None:
        write_noised_partitions(optimizer, self.zero)


def trainable_params(zero: Any) -> List[nn.Parameter]:
    """The parameters ZeRO-3 steps, in its order (the noise stream's parameter index; the client optimizer's
    order, as in one process)."""
    return [p for group in zero.fp16_groups for p in group if p.requires_grad]


#: Elements (of the ranks' padded clipped sums, fp32) reduce-scattered in one collective: 64 MiB at the most.
BUCKET = 1 << 24


@torch.no_grad()
def write_noised_partitions(optimizer: Any, zero: Any) -> None:
    """The step under ZeRO-3: each rank's partition of ``(sum of the ranks' clipped sums + noise) / divisor``
    (the sums already reduce-scattered, :func:`keep_partitions`), written into ZeRO-3's gradient partition of
    every trainable parameter."""
    params = optimizer.params
    if not params:
        return
    noise, std = sharded_noise(optimizer), optimizer.noise_std
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    key = noise.step_key() if std > 0 else None
    if key is not None and world > 1:  # one stream: rank 0's key
        box = [key]
        torch.distributed.broadcast_object_list(box, src=0)
        key = int(box[0])
    for index, param in enumerate(params):
        numel, size = int(param.ds_numel), int(param.partition_numel())
        held = optimizer._summed.get(param)
        part = held.clone() if held is not None else torch.zeros(size, dtype=torch.float32,
                                                                  device=param.ds_tensor.device)
        start = size * int(zero._get_param_partition_rank(param))
        end = min(start + size, numel)
        if std > 0 and end > start:
            part[: end - start] += noise.slice(key, index, numel, start, end, std, dtype=part.dtype,
                                               device=part.device)
        if optimizer.loss_reduction == "mean":  # the plan's constant divisor (see PrivacyPlan.divisor)
            part /= optimizer.plan.divisor
        zero.set_local_grad_for_param(part, param)


@torch.no_grad()
def keep_partitions(optimizer: Any, hooks: Any, factors: Dict[nn.Parameter, torch.Tensor],
                    dropped: Optional[torch.Tensor] = None) -> None:
    """Add this backward pass's clipped sums, summed over the ranks, to this rank's partition of each parameter's
    sum held by the optimizer (``partition_numel()`` elements, ZeRO-3's layout: the last rank's padded).

    Runs on every rank after every backward pass, over all trainable parameters in the optimizer's order (zeros
    for those the pass did not reach: a phantom, an empty micro-batch), so the ranks' collectives pair up:
    reduce-scatters of buckets of at most :data:`BUCKET` elements, whose clipped sums are formed one layer at a
    time (a layer's full-size sums live only until they are copied into the bucket)."""
    params = optimizer.params
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    bucket: List[nn.Parameter] = []
    for param in params:
        if bucket and world * (sum(int(p.partition_numel()) for p in bucket) + int(param.partition_numel())) > BUCKET:
            _reduce_scatter(optimizer, hooks, factors, dropped, bucket, world)
            bucket = []
        bucket.append(param)
    if bucket:
        _reduce_scatter(optimizer, hooks, factors, dropped, bucket, world)


def _reduce_scatter(optimizer: Any, hooks: Any, factors: Dict[nn.Parameter, torch.Tensor],
                    dropped: Optional[torch.Tensor], bucket: List[nn.Parameter], world: int) -> None:
    """One bucket: row ``r`` holds the clipped sums' rank ``r`` partitions side by side; this rank's row of the
    ranks' sum is added to the held partitions."""
    sizes = [int(p.partition_numel()) for p in bucket]
    spans = dict(zip(bucket, zip(itertools.accumulate([0, *sizes[:-1]]), sizes)))  # (offset, size) in a row
    device = bucket[0].ds_tensor.device
    rows = torch.zeros(world, sum(sizes), dtype=torch.float32, device=device)
    for group in groups_by_module(hooks, bucket):
        wanted = {p: factors[p] for p in group if p in factors}
        for param, clipped in (hooks.clipped_sums(wanted, dropped) if wanted else {}).items():
            if clipped.numel() != param.ds_numel:
                raise RuntimeError(f"the clipped sum of {hooks.parameter_name(param)} has {clipped.numel()} elements, "
                                   f"the parameter {param.ds_numel} (shape {tuple(param.ds_shape)}): refused")
            flat = clipped.reshape(-1).to(device=device, dtype=torch.float32)
            offset, size = spans[param]
            for rank in range(world):  # rank r's partition: elements r * size onwards
                piece = flat[rank * size: (rank + 1) * size]
                rows[rank, offset: offset + piece.numel()] = piece
    if world == 1:
        mine = rows[0]
    else:
        mine = rows.new_empty(sum(sizes))
        dist = torch.distributed
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(mine, rows.reshape(-1))  # 2.13
    del rows
    for param, part in zip(bucket, mine.split(sizes)):
        held = optimizer._summed.get(param)
        if held is None:
            optimizer._summed[param] = part
        else:
            held.add_(part)


__all__ = ["BUCKET", "ZERO3_PARTS", "Zero3Partitions", "attach", "carry_batch_tags", "engine_problems", "layer_problems", "noise_problems",
           "keep_partitions", "restore_markers", "trainable_params",
           "write_noised_partitions"]
