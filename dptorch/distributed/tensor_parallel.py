"""Tensor parallelism (``torch.distributed.tensor.parallel``) under DP-SGD: partial norms summed, sliced noise.

Under ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` every rank of the
tensor-parallel group runs the *same* batch, each with its slice of the sharded weights:

* **Per-sample gradients** of a sharded weight are formed on every rank for its slice only (the
  controller hands the layer's samplers the local activations and output gradients). One sample's
  squared norm is therefore the sum of the ranks' partial squared norms: ``complete_norms``
  all-reduces them (one collective of B floats per sharded parameter, one call per backward pass)
  before any clip factor is formed. A replicated parameter (a row-wise layer's bias) has its whole
  per-sample gradient on every rank and is counted once.
* **Clipped sums** need no collective: every rank forms its slice of the one clipped sum.
* **Noise** is one draw per element of the full parameter: each rank adds its slice of one stream
  (``ShardedNoise``; rank 0's step key, broadcast), a replicated parameter gets the same draw on
  every rank (secure noise: drawn on rank 0 and broadcast).
* **The batch** must be the same on every rank (a row-wise layer's all-reduce adds the ranks' rows
  position by position): ``check_same_batch`` compares the root inputs of every forward across the
  group exactly, and ``mirror_draws`` makes the Poisson sampler's draw rank 0's on every rank.

Supported: a 1-D mesh spanning the whole world (tensor parallelism alone), ``nn.Linear`` layers
split column-wise (weight and bias ``Shard(0)``) or row-wise (weight ``Shard(1)``, bias
``Replicate()``), local inputs and outputs. Refused when the controller attaches: any other layer
with DTensor parameters (``SequenceParallel``'s norms, an embedding split by rows), other
placements, 2-D meshes (TP with FSDP2 or DDP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dptorch.distributed.fsdp import fully_shard_params, is_sharded, shard_layout, sharded_noise


@dataclass(frozen=True)
class TensorParallelLayout:
    """Where this rank's slice of a tensor-parallel parameter lies in the full parameter."""

    mesh: Any
    group: Any
    rank: int  # in the tensor-parallel group
    world_size: int
    shape: Tuple[int, ...]  # of the full parameter
    dim: Optional[int]  # the split dim; None for a replicated parameter
    start: int = 0
    end: int = 0

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a tensor of the full parameter's shape."""
        return full if self.dim is None else full.narrow(self.dim, self.start, self.end - self.start)


def _placement_dim(placement: Any) -> Optional[int]:
    """The dim a ``Shard`` placement splits, None for ``Replicate``; anything else is refused."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(placement, Replicate):
        return None
    if type(placement) is Shard:
        return placement.dim
    raise ValueError(f"placement {placement}")


_LINEAR_SPLITS = {(0, 0): "column-wise", (1, None): "row-wise", (0, None): "column-wise"}


def tensor_parallel_params(module: nn.Module, managed: Sequence[Any] = ()) -> Dict[nn.Parameter, TensorParallelLayout]:
    """The tensor-parallel parameters of ``module`` (DTensors not in ``managed``, FSDP2's shards), each
    with its layout; refused, with the reason, where the DP optimizer could not form exact per-sample
    norms (see the module docstring)."""
    managed = set(managed)
    layouts: Dict[nn.Parameter, TensorParallelLayout] = {}
    for name, sub in module.named_modules():
        own = {n: p for n, p in sub.named_parameters(recurse=False) if is_sharded(p) and p not in managed}
        if not own:
            continue
        label = name or type(module).__name__
        if type(sub) is not nn.Linear:
            raise ValueError(
                f"{label} ({type(sub).__name__}) has DTensor parameters {sorted(own)} that fully_shard does not manage: "
                "tensor parallelism is supported for nn.Linear layers split by ColwiseParallel or RowwiseParallel "
                "only (SequenceParallel splits the tokens of one sample across the ranks, an embedding split by rows "
                "gives each rank part of a sample's lookups). Leave this layer replicated, or freeze its parameters"
            )
        weight, bias = sub.weight, sub.bias
        dims = []
        for p in (weight, bias):
            if p is None:
                continue
            if not is_sharded(p):
                raise ValueError(f"{label}: its weight and bias must both be DTensors of one mesh (one is a plain tensor)")
            mesh = p.device_mesh
            if mesh.ndim != 1 or len(p.placements) != 1:
                raise ValueError(
                    f"{label}: a DTensor parameter on a {mesh.ndim}-D mesh with placements {tuple(p.placements)}; "
                    "tensor parallelism is supported on a 1-D mesh (TP with FSDP2 or DDP on a 2-D mesh is not yet)"
                )
            try:
                dims.append(_placement_dim(p.placements[0]))
            except ValueError:
                raise ValueError(f"{label}: placement {p.placements[0]} is not supported (Shard or Replicate only)") from None
        key = (dims[0], dims[1] if len(dims) > 1 else None)
        if key not in _LINEAR_SPLITS or (key == (0, None) and bias is not None):
            raise ValueError(
                f"{label}: weight and bias placements {tuple(dims)} (split dims; None: replicated) are neither "
                "ColwiseParallel's (Shard(0), Shard(0)) nor RowwiseParallel's (Shard(1), Replicate())"
            )
        mesh = weight.device_mesh
        world = torch.distributed.get_world_size()
        if mesh.size() != world:
            raise ValueError(
                f"{label}: its tensor-parallel mesh has {mesh.size()} of the {world} processes; tensor parallelism "
                "is supported on a mesh of the whole world (TP alone); TP with data parallelism is not yet"
            )
        for p, dim in zip((weight, bias), dims):
            layouts[p] = _layout(p, dim, f"{label}.{'weight' if p is weight else 'bias'}")
    groups = {id(layout.mesh) for layout in layouts.values()}
    if len(groups) > 1:
        raise ValueError("the tensor-parallel layers are on different device meshes; one mesh is supported")
    return layouts


def check_sharding(module: nn.Module) -> Dict[nn.Parameter, Any]:
    """Refuse, before anything is attached, DTensor parameters private training cannot keep exact;
    the tensor-parallel layouts of the parameters (empty without tensor parallelism).

    FSDP2's (and HSDP's) shards are gathered for their layer's call. A DTensor that ``fully_shard``
    does not manage is a tensor-parallel slice: each rank computes with its slice of the weight, so
    one sample's gradient is split across the ranks; ``tensor_parallel`` supports the splits whose
    partial norms it can add up (and refuses the others), on a mesh of its own (TP with FSDP2 is
    refused).
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad and is_sharded(p)]
    if not named:
        return {}
    managed = fully_shard_params(module)
    foreign = [name for name, p in named if p not in managed]
    if foreign and len(foreign) < len(named):
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise ValueError(
            f"parameters {shown} are DTensors that fully_shard does not manage (tensor parallelism: "
            "parallelize_module with ColwiseParallel / RowwiseParallel / SequenceParallel, or DTensors made by hand), "
            "in a model FSDP2 shards too: tensor parallelism with FSDP2 (a 2-D mesh) is not supported yet, since "
            "each rank would hold part of a sample's gradient in a layer FSDP2 does not gather. Use tensor "
            "parallelism alone, FSDP2 (fully_shard) or HSDP alone, or DDP"
        )
    if foreign:
        return tensor_parallel_params(module)  # refuses the splits whose per-sample norms it cannot complete
    for name, p in named:
        shard_layout(p, name)  # refuses placements other than FSDP2's and HSDP's
    return {}


def _layout(param: Any, dim: Optional[int], name: str) -> TensorParallelLayout:
    mesh = param.device_mesh
    group, rank, world = mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0)
    shape = tuple(param.shape)
    if dim is None:
        return TensorParallelLayout(mesh, group, rank, world, shape, None)
    per_rank = -(-shape[dim] // world)  # DTensor's Shard: torch.chunk semantics
    start, end = min(rank * per_rank, shape[dim]), min((rank + 1) * per_rank, shape[dim])
    layout = TensorParallelLayout(mesh, group, rank, world, shape, dim, start, end)
    expected = tuple(end - start if d == dim else size for d, size in enumerate(shape))
    if tuple(param.to_local().shape) != expected:
        raise ValueError(f"{name}: the local slice has shape {tuple(param.to_local().shape)}, not the {expected} of an "
                         f"even split of dim {dim} over {world} ranks; this split is not supported")
    return layout


def local_part(t: Any, batch_dim: Optional[int]) -> Any:
    """A layer input or output gradient as this rank computed with it: a DTensor's local tensor, whose
    batch dim (``batch_dim``) must be whole on every rank (its split dims are feature dims)."""
    if not is_sharded(t):
        return t
    from torch.distributed.tensor import Replicate, Shard

    for placement in t.placements:
        whole = isinstance(placement, Replicate) or (
            type(placement) is Shard and batch_dim is not None and placement.dim % t.dim() != batch_dim)
        if not whole:
            raise ValueError(
                f"a tensor-parallel layer's input or output gradient is a DTensor with placements {tuple(t.placements)}: "
                f"its batch (dim {batch_dim}) must be whole on every rank (Replicate, or a split of a feature dim)"
            )
    return t.to_local()


def local_shape(t: Any) -> torch.Size:
    """The shape of the tensor this rank holds (a DTensor's local one)."""
    return t.to_local().shape if is_sharded(t) else t.shape


def complete_norms(norms: Dict[nn.Parameter, torch.Tensor], layouts: Dict[nn.Parameter, TensorParallelLayout]) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample norms of the whole parameters, the same on every rank, in one collective: a split
    parameter's partial squared norms summed over the group, every other parameter's taken from rank 0
    (whose clipped sums ``add_noise_tensor_parallel`` hands to all), so the clip factors agree."""
    if not norms:
        return norms
    group = next(iter(layouts.values())).group
    first = torch.distributed.get_rank(group) == 0
    params = list(norms)
    squares = torch.stack([norms[p].float() ** 2 for p in params])
    for row, p in enumerate(params):
        if not (p in layouts and layouts[p].sharded) and not first:
            squares[row] = 0
    torch.distributed.all_reduce(squares, group=group)
    return {p: value.clamp(min=0).sqrt().to(norms[p].dtype) for p, value in zip(params, squares)}


def check_same_batch(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Refuse, on every rank alike, a forward whose root inputs differ across the tensor-parallel group.

    Exact: the element-wise maximum and minimum over the group (two all-reduces per input) are equal
    everywhere iff every rank holds the same values (shapes are compared first)."""
    dist = torch.distributed
    shapes = torch.tensor([d for t in tensors for d in (t.dim(), *t.shape)] or [0], dtype=torch.float64)
    sizes = torch.tensor([float(shapes.numel())], dtype=torch.float64)
    same = _agrees(sizes, group) and _agrees(shapes, group)
    if same:
        for t in tensors:
            if t.numel() and not _agrees(t.detach().reshape(-1), group):
                same = False
                break
    if not same:
        raise ValueError(
            "the ranks of the tensor-parallel group ran forwards on different inputs: every rank of the group must "
            "run the same batch (its row-wise layers add the ranks' rows position by position, so different rows "
            "would mix samples). Give every rank the same loader (make_private sets each DPDataLoader's draws to "
            "rank 0's) and the same data"
        )


def _agrees(t: torch.Tensor, group: Any) -> bool:
    """Whether ``t`` is the same on every rank of ``group`` (the result is the same on every rank)."""
    dist = torch.distributed
    wide = t.double() if t.is_floating_point() or t.dtype == torch.bool else t.long()
    high, low = wide.clone(), wide.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    return bool(torch.equal(high, low))


def context_parallel_active() -> bool:
    """Whether torch's context parallelism is on (``context_parallel`` patched SDPA, or its DTensor
    handlers are enabled): it splits every sample's tokens over the ranks, so no rank holds a sample's
    gradient, and attention meets the other ranks' tokens through collectives the tracker cannot see."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):  # it needs a device mesh
        return False
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    except ImportError:  # no context parallelism in this torch
        return False
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", {}) or {}
    patched = torch.nn.functional.scaled_dot_product_attention in getattr(cp, "_replaced_functions", {})
    return patched or any(op in handlers for op in getattr(cp, "custom_ops", {}))


def add_noise_tensor_parallel(optimizer: Any, params: Sequence[nn.Parameter], layouts: Dict[nn.Parameter, TensorParallelLayout]) -> None:
    """Write ``p.grad = (clipped sum + noise) / expected batch size`` on every rank of the group.

    The noise of parameter ``i`` is element-wise the one-process stream of ``ShardedNoise`` (rank 0's
    key, broadcast): a split parameter takes its slice of it on each rank (secure noise: each rank
    draws its own slice, one draw per element over the group). Every other parameter (replicated or
    plain) gets rank 0's clipped sum and noise, broadcast: the same gradient on every rank.
    """
    from torch.distributed.tensor import DTensor

    dist = torch.distributed
    noise = sharded_noise(optimizer)
    std = optimizer.noise_std
    group = next(iter(layouts.values())).group
    source = dist.get_global_rank(group, 0)
    key = noise.step_key() if std > 0 else None
    if key is not None:
        box = [key]
        dist.broadcast_object_list(box, src=source, group=group)
        key = int(box[0])
    locals_: List[torch.Tensor] = []
    whole: List[int] = []
    for index, p in enumerate(params):
        layout = layouts.get(p)
        split = layout is not None and layout.sharded
        value = p.to_local() if layout is not None else p
        held = optimizer._summed.get(p)
        local = (held.reshape(value.shape).float().clone() if held is not None
                 else torch.zeros(value.shape, dtype=torch.float32, device=value.device))
        if std > 0 and split and noise.secure:
            local.view(-1).add_(noise.slice(None, index, local.numel(), 0, local.numel(), std, device=local.device))
        elif std > 0 and split:
            full = noise.slice(key, index, p.numel(), 0, p.numel(), std, device=local.device).view(layout.shape)
            local.add_(layout.local_of(full))
        elif std > 0:
            local.view(-1).add_(noise.slice(key, index, p.numel(), 0, p.numel(), std, device=local.device))
        if not split:
            whole.append(index)
        locals_.append(local)
    if whole:  # rank 0's clipped sum and noise everywhere
        flat = torch.cat([locals_[i].reshape(-1) for i in whole])
        dist.broadcast(flat, src=source, group=group)
        for i, piece in zip(whole, flat.split([locals_[i].numel() for i in whole])):
            locals_[i] = piece.view_as(locals_[i])
    for p, local in zip(params, locals_):
        if optimizer.loss_reduction == "mean":  # the plan's constant divisor (see PrivacyPlan.divisor)
            local = local / optimizer.plan.divisor
        if p in layouts:
            p.grad = DTensor.from_local(local.to(p.dtype), p.device_mesh, p.placements, shape=p.shape,
                                        stride=p.stride(), run_check=False)
        else:
            p.grad = local.to(p.dtype)


__all__ = [
    "TensorParallelLayout",
    "add_noise_tensor_parallel",
    "check_sharding",
    "check_same_batch",
    "complete_norms",
    "context_parallel_active",
    "local_part",
    "local_shape",
    "tensor_parallel_params",
]
