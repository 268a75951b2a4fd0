"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under DP-SGD: sharded clipped sums, sliced noise.

What FSDP2 changes, and what dptorch does about it:

* **Parameters** are DTensors sharded along dim 0 over a 1-D device mesh (or, under HSDP, over the
  shard dimension of a 2-D ``(replicate, shard)`` mesh); during a layer's
  forward (and again in its backward) FSDP2 puts the all-gathered, unsharded parameter in its
  place. The controller remembers each gathered parameter as an alias of the sharded one and
  keys every per-sample result by the sharded parameter (the one the optimizer holds). As on one
  process, the gathered parameters stop requiring grad during the layer's call, so autograd
  computes no weight gradient and FSDP2 reduce-scatters nothing; the one backward pass yields the
  activations and output gradients the strategies need (``bk`` and ghost included).
* **Per-sample norms** are formed on the rank that holds the sample: the forward and backward of
  a sample run there with every layer's full (gathered) parameters, so the norm over all layers
  and all uses is complete on that rank before any clip factor is formed. No other rank has any
  part of that sample's gradient, so there is nothing to add from elsewhere (tensor or sequence
  parallelism, which would split one sample's gradient, are not supported).
* **Clipped sums** of a backward pass are formed one layer at a time at full size (as FSDP2's own
  unsharded gradient would be), reduce-scattered over the mesh at once, and only the rank's shard
  is kept: the accumulator of a step is sharded. Every rank must therefore run the same number of
  backward passes per step (FSDP2's all-gathers already require the same number of forwards), in
  the same order of parameters: an empty (Poisson) micro-batch must still go through forward and
  backward. ``BatchMemoryManager`` gives every rank the same number of physical batches; the private
  Trainer runs an empty micro-batch as a phantom (``dptorch.integrations.hf.phantom``), whose round
  the DP optimizer reduce-scatters as zeros.
* **Noise**: each rank adds its shard's slice of one global stream (``noise.ShardedNoise``), then
  divides by the expected batch size; ``p.grad`` is a DTensor like the parameter.
* **HSDP** (``fully_shard(mesh=...)`` on a 2-D ``(replicate, shard)`` mesh, placements
  ``(Replicate(), Shard(0))``): the reduce-scatter of every backward pass runs inside the rank's
  shard group, so the accumulator holds this replica's sum; at ``step()`` only the ranks of replica
  0 add their shard's noise, then the shards are all-reduced over the replicate group. Every
  element gets one draw over the whole mesh, and every replica ends with the same gradient.

* **CPU offloading** (``offload_policy=CPUOffloadPolicy()``): the clipped sums are formed and
  reduce-scattered on the compute device, then each shard moves to the CPU, where the shard lives,
  its noise is drawn and the optimizer steps (as FSDP2's own offloaded gradients do).

Refused: other meshes and placements (TP with FSDP2 on a 2-D mesh, DTensors made by hand;
custom shard placements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dptorch.distributed.ddp import rank_and_world_size
from dptorch.distributed.noise import ShardedNoise


def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_sharded(param: Any) -> bool:
    """Whether ``param`` is a DTensor (a parameter sharded by FSDP2's ``fully_shard``)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(param, dtensor)


def is_fully_sharded_module(module: Any) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def fully_shard_params(module: nn.Module) -> Dict[nn.Parameter, torch.device]:
    """The parameters ``fully_shard`` manages anywhere in ``module`` (its sharded DTensors), each with
    the device its layer computes on (the shard's, except under CPU offloading, where the shard lives
    on the CPU and the layer runs on the accelerator); refused where FSDP2's internals do not say."""
    managed: Dict[nn.Parameter, torch.device] = {}
    for sub in module.modules():
        if not is_fully_sharded_module(sub):
            continue
        try:
            groups = sub._get_fsdp_state()._fsdp_param_groups
            managed.update((fsdp_param.sharded_param, fsdp_param.device)
                           for group in groups for fsdp_param in group.fsdp_params)
        except AttributeError as error:  # FSDP2's internals moved: which DTensors are its shards is unknown
            raise ValueError(
                f"cannot tell which parameters fully_shard manages in this torch version ({error}): a DTensor "
                "it does not gather for its layer's call (tensor parallelism) would split each sample's gradient, "
                "so private training under FSDP2 is refused here. Use the torch version dptorch supports, or DDP"
            ) from error
    return managed


def any_sharded(params: Sequence[Any]) -> bool:
    return any(is_sharded(p) for p in params)


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's shard of a dim-0-sharded parameter lies in the full parameter."""

    group: Any  # the shard group
    rank: int  # in the shard group
    world_size: int  # of the shard group
    shape: Tuple[int, ...]  # of the full parameter
    rows_per_rank: int  # torch.chunk semantics: ceil(rows / world_size)
    row_start: int
    row_end: int
    replicas: Any = None  # HSDP: the replicate group (ranks holding this same shard); None on a 1-D mesh
    replica: int = 0  # HSDP: this rank's index in the replicate group

    @property
    def row_numel(self) -> int:
        numel = 1
        for size in self.shape[1:]:
            numel *= size
        return numel

    @property
    def numel(self) -> int:
        return self.shape[0] * self.row_numel if self.shape else 1

    @property
    def element_range(self) -> Tuple[int, int]:
        return self.row_start * self.row_numel, self.row_end * self.row_numel

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return (self.row_end - self.row_start, *self.shape[1:])


def _is_plain_sharding(placements: Tuple[Any, ...]) -> bool:
    """``(Shard(0),)`` on a 1-D mesh, or HSDP's ``(Replicate(), Shard(0))`` on a 2-D one."""
    from torch.distributed.tensor import Replicate, Shard

    last = placements[-1] if placements else None
    if not isinstance(last, Shard) or last.dim != 0:
        return False
    return len(placements) == 1 or (len(placements) == 2 and isinstance(placements[0], Replicate))


def shard_layout(param: Any, name: str = "") -> ShardLayout:
    """The layout of ``param`` (a DTensor): dim-0 sharding on a 1-D mesh, or HSDP on a 2-D one; anything else is refused."""
    label = f" {name}" if name else ""
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim != len(placements) or not _is_plain_sharding(placements):
        raise ValueError(
            f"parameter{label} is a DTensor with placements {placements} on a {mesh.ndim}-D mesh; private training "
            "supports FSDP2's sharding (fully_shard: Shard(0) on a 1-D mesh) and HSDP ((Replicate(), Shard(0)) on a "
            "2-D (replicate, shard) mesh) only. Tensor parallelism and custom shard placements are not supported"
        )
    if len(param.shape) == 0:
        raise ValueError(f"parameter{label} is a 0-dimensional DTensor; it cannot be sharded along dim 0")
    shard_dim = mesh.ndim - 1
    group = mesh.get_group(shard_dim)
    rank, world = mesh.get_local_rank(shard_dim), mesh.size(shard_dim)
    replicas, replica = (mesh.get_group(0), mesh.get_local_rank(0)) if mesh.ndim == 2 else (None, 0)
    rows = param.shape[0]
    per_rank = -(-rows // world)
    start, end = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
    layout = ShardLayout(group, rank, world, tuple(param.shape), per_rank, start, end, replicas, replica)
    if tuple(param.to_local().shape) != layout.local_shape:
        raise ValueError(
            f"parameter{label}: the local shard has shape {tuple(param.to_local().shape)}, not the "
            f"{layout.local_shape} of an even dim-0 split over {world} ranks; this sharding is not supported"
        )
    return layout


def reduce_to_shard(full: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The sum of every rank's ``full`` (the parameter's full shape), restricted to this rank's shard."""
    dist = torch.distributed
    rows, per_rank, world = layout.shape[0], layout.rows_per_rank, layout.world_size
    full = full.reshape(layout.shape)
    if world == 1:
        return full.clone()
    padded_rows = per_rank * world
    if padded_rows != rows:
        full = torch.cat([full, full.new_zeros((padded_rows - rows, *layout.shape[1:]))])
    out = full.new_empty((per_rank, *layout.shape[1:]))
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    reduce_scatter(out, full.contiguous(), group=layout.group)
    return out[: layout.row_end - layout.row_start]


def shard_layouts(optimizer: Any, params: Sequence[nn.Parameter]) -> Dict[nn.Parameter, ShardLayout]:
    """The shard layouts of ``params`` (cached on the optimizer; TP x FSDP2 puts its own in first)."""
    cache = optimizer.__dict__.setdefault("_dp_shard_layouts", {})
    for p in params:
        if p not in cache:
            cache[p] = shard_layout(p, optimizer.hooks.parameter_name(p))
    return cache


def _compute_device(optimizer: Any, param: nn.Parameter) -> torch.device:
    cache = optimizer.__dict__.get("_dp_compute_devices")
    if cache is None or param not in cache:
        cache = optimizer.__dict__["_dp_compute_devices"] = fully_shard_params(optimizer.hooks.module)
    return cache.get(param, param.to_local().device)


def groups_by_module(hooks: Any, params: Sequence[nn.Parameter]) -> List[List[nn.Parameter]]:
    """``params`` grouped by the module that owns them directly (one clipped-sum call per layer)."""
    owner: Dict[nn.Parameter, int] = {}
    for index, module in enumerate(hooks.module.modules()):
        for p in module.parameters(recurse=False):
            owner.setdefault(p, index)
    groups: Dict[int, List[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(owner.get(p, -1 - len(groups)), []).append(p)
    return list(groups.values())


def accumulate_sharded(optimizer: Any, hooks: Any, factors: Dict[nn.Parameter, torch.Tensor], dropped: Optional[torch.Tensor] = None) -> None:
    """Add this backward pass's clipped sums, summed over the ranks, to the optimizer's sharded accumulator.

    Runs on every rank after every backward pass, over all trainable sharded parameters in the
    optimizer's order (zeros for those this rank's pass did not reach), so the collectives match.
    """
    params = [p for p in optimizer.params if is_sharded(p)]
    layouts = shard_layouts(optimizer, params)
    for group in groups_by_module(hooks, params):
        wanted = {p: factors[p] for p in group if p in factors}
        sums = hooks.clipped_sums(wanted, dropped) if wanted else {}
        for p in group:
            layout = layouts[p]
            full = sums.pop(p, None)
            if full is None:
                full = torch.zeros(layout.shape, dtype=torch.float32, device=_compute_device(optimizer, p))
            shard = reduce_to_shard(full if full.dtype == torch.float64 else full.float(), layout)
            shard = shard.to(p.to_local().device)  # CPU offloading: the shard (and its noise) live on the CPU
            held = optimizer._summed.get(p)
            optimizer._summed[p] = shard if held is None else held + shard


def sharded_noise(optimizer: Any) -> ShardedNoise:
    """The optimizer's noise generator as a ``ShardedNoise`` (wrapping the one it had)."""
    generator = optimizer.noise_generator
    if not isinstance(generator, ShardedNoise):
        generator = optimizer.noise_generator = ShardedNoise(generator)
    return generator


def collective_into(tensors: List[torch.Tensor], indices: List[int], collective: Callable[[torch.Tensor], Any]) -> None:
    """Run ``collective`` (in place) on ``tensors[i]`` for ``i`` in ``indices`` flattened into one tensor,
    putting the results in place of the originals: one collective for them all."""
    flat = torch.cat([tensors[i].flatten() for i in indices])
    collective(flat)
    for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices])):
        tensors[i] = piece.view_as(tensors[i])


def _all_reduce_into(tensors: List[torch.Tensor], indices: List[int], group: Any) -> None:
    """Sum ``tensors[i]`` for ``i`` in ``indices`` over ``group``, in one collective, in place of the originals."""
    collective_into(tensors, indices, lambda flat: torch.distributed.all_reduce(flat, group=group))


def write_noised_grads(optimizer: Any, params: Sequence[nn.Parameter], locals_: Sequence[torch.Tensor]) -> None:
    """``p.grad`` from each parameter's noised clipped sum (this rank's part of it): divided by the plan's
    constant under ``loss_reduction="mean"``, a DTensor like the parameter where it is one."""
    for p, local in zip(params, locals_):
        if optimizer.loss_reduction == "mean":  # the plan's constant divisor (see PrivacyPlan.divisor)
            local = local / optimizer.plan.divisor
        if is_sharded(p):
            from torch.distributed.tensor import DTensor

            p.grad = DTensor.from_local(local.to(p.dtype), p.device_mesh, p.placements, shape=p.shape,
                                        stride=p.stride(), run_check=False)
        else:
            p.grad = local.view_as(p).to(p.dtype)


def add_noise_per_parameter(optimizer: Any, params: Sequence[nn.Parameter]) -> None:
    """Write ``p.grad = (clipped sum + noise) / expected batch size``, noise drawn per parameter element.

    Sharded parameters: the clipped sums are already summed over the ranks and sharded
    (``accumulate_sharded``); each rank adds its shard's slice of the step's noise stream (under
    HSDP the ranks of replica 0 only, then the shards are summed over the replicate group).
    Replicated parameters (one process, or DDP): rank 0 adds the whole noise, then the sums are
    all-reduced, as in ``DPOptimizer.add_noise``; with a ``ShardedNoise`` the values are the
    same as the sharded ones, so 1-process, DDP and FSDP2 runs draw identical noise.
    """
    noise = sharded_noise(optimizer)
    std = optimizer.noise_std
    sharded = [p for p in params if is_sharded(p)]
    layouts = shard_layouts(optimizer, sharded)
    rank, world = rank_and_world_size()
    key = noise.step_key() if std > 0 else None
    if key is not None and layouts:
        group = next(iter(layouts.values())).group
        if torch.distributed.get_world_size(group) > 1:  # one stream: rank 0's key, whatever the others drew
            box = [key]
            torch.distributed.broadcast_object_list(box, src=torch.distributed.get_global_rank(group, 0), group=group)
            key = int(box[0])
    locals_: List[torch.Tensor] = []
    replicated: List[int] = []
    for index, p in enumerate(params):
        held = optimizer._summed.get(p)
        if is_sharded(p):
            layout = layouts[p]
            device = p.to_local().device
            local = held if held is not None else torch.zeros(layout.local_shape, dtype=torch.float32, device=device)
            start, end = layout.element_range
            draws = layout.replica == 0  # HSDP: one replica draws, the replicate all-reduce shares it
        else:
            device = p.device
            local = held.to(device) if held is not None else torch.zeros(p.shape, dtype=torch.float32, device=device)
            start, end = 0, p.numel()
            draws = rank == 0
            replicated.append(index)
        local = local.float() if local.dtype not in (torch.float32, torch.float64) else local.clone()
        if std > 0 and draws:
            numel = layouts[p].numel if is_sharded(p) else p.numel()
            local.view(-1).add_(noise.slice(key, index, numel, start, end, std, dtype=local.dtype, device=device))
        locals_.append(local)
    if world > 1 and replicated:
        _all_reduce_into(locals_, replicated, group=None)
    across_replicas: Dict[Any, List[int]] = {}
    for index, p in enumerate(params):
        if is_sharded(p) and layouts[p].replicas is not None:
            across_replicas.setdefault(layouts[p].replicas, []).append(index)
    for group, indices in across_replicas.items():  # HSDP: the replicas' sums (noise from replica 0 only)
        _all_reduce_into(locals_, indices, group=group)
    write_noised_grads(optimizer, params, locals_)


class ShardedParameters:
    """The DP optimizer's gradient writer (``dptorch.optim.gradient_writer``) for FSDP2 and HSDP shards: the clipped
    sums of the sharded parameters are reduce-scattered after every backward pass (``accumulate_sharded``, on every
    rank, zeros for a pass that adds nothing), the others are left to the optimizer whole; the step's noise is
    drawn per element (``add_noise_per_parameter``)."""

    def keep(self, optimizer: Any, hooks: Any, factors: Dict[nn.Parameter, torch.Tensor],
             dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
        accumulate_sharded(optimizer, hooks, factors, dropped)
        return {p: f for p, f in factors.items() if not is_sharded(p)}

    def write(self, optimizer: Any, params: Sequence[nn.Parameter]) -> None:
        add_noise_per_parameter(optimizer, params)


__all__ = [
    "ShardLayout",
    "ShardedParameters",
    "is_fully_sharded_module",
    "accumulate_sharded",
    "add_noise_per_parameter",
    "any_sharded",
    "collective_into",
    "fully_shard_params",
    "groups_by_module",
    "is_sharded",
    "reduce_to_shard",
    "shard_layout",
    "shard_layouts",
    "sharded_noise",
    "write_noised_grads",
]
