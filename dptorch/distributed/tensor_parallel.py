"""Tensor parallelism (``torch.distributed.tensor.parallel``) under DP-SGD: partial norms summed, sliced noise.

Under ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` every rank of a
tensor-parallel group runs the *same* batch, each with its slice of the split weights:

* **Per-sample gradients** of a split weight are formed on every rank for its slice only (the
  controller hands the layer's samplers the local inputs and output gradients). One sample's
  squared norm is the sum of the ranks' partial squared norms: ``complete_norms`` all-reduces them
  (one collective per backward pass) before any clip factor is formed. Every other parameter (a
  row-wise layer's bias, the embedding, the norms) takes the group's rank 0's norm, so every rank
  forms the same clip factors.
* **Clipped sums** need no collective over the group: every rank forms its slice of the one sum.
* **Noise** is the one-process stream element by element (``ShardedNoise``; global rank 0's key,
  broadcast): a split parameter takes each rank's slice (secure noise: each rank draws its own
  elements); every other parameter gets the group's rank 0's clipped sum and noise, broadcast.
* **The batch** must be the same on every rank of the group (a row-wise layer's all-reduce adds the
  ranks' rows position by position): ``check_same_batch`` compares the root inputs of every forward
  across the group exactly, and the Poisson sampler's draws are the group's rank 0's
  (``dptorch.data.poisson.mirror_draws``).

**TP x FSDP2**: ``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard`` on ``mesh["dp"]`` of one
2-D ``(dp, tp)`` mesh. Each tensor-parallel parameter is a 2-D DTensor FSDP2 shards over dp: FSDP2
gathers the slice for the layer's call, the clipped sums are reduce-scattered over dp within the
slice (``dptorch.distributed.fsdp.accumulate_sharded`` with ``data_parallel_shard_layout``), and the
noise takes this rank's rows of its slice. The draws are sharded over dp and mirrored within tp.

**SequenceParallel**: a layer whose parameters are all replicated over the group (torch's
``SequenceParallel`` on a norm, ``replicated_layer``) sees this rank's slice of every sample's tokens
(``token_split_part``): its per-sample gradients are this rank's part of each sample's, summed over the
group (``sum_partial_gradients``) before any norm. Its neighbours' per-sample math is unchanged: a
column-wise layer gathering the tokens computes with all of them; a row-wise one scattering its output
over the tokens is tapped before that scatter, where its output gradient covers every token.

Supported: ``nn.Linear`` layers split column-wise (weight and bias ``Shard(0)``) or row-wise (weight
``Shard(1)``, bias ``Replicate()``), local inputs and outputs, an embedding split by rows, layers with
only replicated parameters, on a 1-D mesh of the whole world or the tp dim of a (dp, tp) mesh. Refused
when the controller attaches: any other layer with DTensor parameters, other placements, TP and FSDP2
on separate meshes, TP x DDP; context parallelism at every forward (``context_parallel_active``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dptorch.distributed.fsdp import (
    ShardLayout,
    ShardedParameters,
    collective_into,
    fully_shard_params,
    is_sharded,
    shard_layout,
    shard_layouts,
    sharded_noise,
    write_noised_grads,
)


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
    with_fsdp: bool = False  # TP x FSDP2: the parameter is a 2-D (dp, tp) DTensor FSDP2 shards over dp

    @property
    def local_shape(self) -> Tuple[int, ...]:
        """The shape of this rank's tensor-parallel slice (what the layer computes with)."""
        return tuple(self.end - self.start if d == self.dim else n for d, n in enumerate(self.shape))

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


def _is_dp_shard(placement: Any) -> bool:
    """FSDP2's placement on the data-parallel dim of a TP x FSDP2 parameter: Shard(0), or the strided
    Shard(0) it uses when tensor parallelism splits dim 0 too."""
    from torch.distributed.tensor import Shard

    strided = type(placement).__name__ == "_StridedShard"  # torch's name for it (not a Shard subclass)
    return (isinstance(placement, Shard) or strided) and getattr(placement, "dim", None) == 0


def _tensor_parallel_dim(p: Any, managed: Any) -> Optional[int]:
    """The mesh dim along which ``p`` is a tensor-parallel slice (None: not one)."""
    if not is_sharded(p):
        return None
    if p not in managed:  # parallelize_module alone
        return 0
    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim == 2 and len(placements) == 2 and _is_dp_shard(placements[0]):  # FSDP2 over dp, TP over tp
        return 1
    return None  # FSDP2's or HSDP's own shards


def tensor_parallel_params(module: nn.Module, managed: Any = ()) -> Dict[nn.Parameter, TensorParallelLayout]:
    """The tensor-parallel parameters of ``module`` (alone, or sharded by FSDP2 over the other dim of a
    2-D mesh; ``managed``: FSDP2's shards), each with its layout; refused, with the reason, where the DP
    optimizer could not form exact per-sample norms (see the module docstring)."""
    managed = managed if isinstance(managed, (dict, set)) else set(managed)
    layouts: Dict[nn.Parameter, TensorParallelLayout] = {}
    for name, sub in module.named_modules():
        own = {n: p for n, p in sub.named_parameters(recurse=False) if _tensor_parallel_dim(p, managed) is not None}
        if not own:
            continue
        label = name or type(module).__name__
        if _split_kind(sub) is None and replicated_layer(sub, own, managed):
            for p_name, p in own.items():  # SequenceParallel's norms: whole weights, each rank some tokens
                _check_whole_world(p.device_mesh, label)
                layouts[p] = _layout(p, None, _tensor_parallel_dim(p, managed), f"{label}.{p_name}")
            continue
        if _split_kind(sub) is None:
            raise ValueError(
                f"{label} ({type(sub).__name__}) has tensor-parallel DTensor parameters {sorted(own)}: tensor "
                "parallelism is supported for nn.Linear layers split column- or row-wise, nn.Embedding split by "
                "rows (vocabulary) and layers whose parameters are all replicated (SequenceParallel's norms) only: "
                "a layer of another kind has no rule for its slices. Leave this layer replicated, or freeze its parameters"
            )
        weight, bias = sub.weight, getattr(sub, "bias", None)
        dims, mesh_dims = [], []
        for p in (weight, bias):
            if p is None:
                continue
            mesh_dim = _tensor_parallel_dim(p, managed)
            if mesh_dim is None:
                raise ValueError(f"{label}: its weight and bias must both be tensor-parallel DTensors of one mesh")
            mesh = p.device_mesh
            if mesh_dim == 0 and (mesh.ndim != 1 or len(p.placements) != 1):
                raise ValueError(
                    f"{label}: a DTensor parameter on a {mesh.ndim}-D mesh with placements {tuple(p.placements)}; "
                    "tensor parallelism is supported on a 1-D mesh, or on the second dim of a (dp, tp) mesh whose "
                    "first dim FSDP2 shards"
                )
            try:
                dims.append(_placement_dim(p.placements[mesh_dim]))
            except ValueError:
                raise ValueError(f"{label}: placement {p.placements[mesh_dim]} is not supported (Shard or Replicate "
                                 "only)") from None
            mesh_dims.append(mesh_dim)
        key = (dims[0], dims[1] if len(dims) > 1 else None)
        if _split_kind(sub) == "embedding" and key != (0, None):
            raise ValueError(f"{label}: an embedding split along dim {dims[0]}; only a split of its rows (the "
                             "vocabulary: RowwiseParallel, transformers' embedding_rowwise) is supported")
        if key not in _LINEAR_SPLITS or (key == (0, None) and bias is not None):
            raise ValueError(
                f"{label}: weight and bias placements {tuple(dims)} (split dims; None: replicated) are neither "
                "ColwiseParallel's (Shard(0), Shard(0)) nor RowwiseParallel's (Shard(1), Replicate())"
            )
        _check_whole_world(weight.device_mesh, label)
        for p, dim, mesh_dim in zip((weight, bias), dims, mesh_dims):
            layouts[p] = _layout(p, dim, mesh_dim, f"{label}.{'weight' if p is weight else 'bias'}")
    meshes = {(tuple(layout.mesh.mesh.shape), tuple(layout.mesh.mesh.flatten().tolist())) for layout in layouts.values()}
    if len(meshes) > 1:
        raise ValueError("the tensor-parallel layers are on different device meshes; one mesh is supported")
    return layouts


def _check_whole_world(mesh: Any, label: str) -> None:
    world = torch.distributed.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"{label}: its device mesh has {mesh.size()} of the {world} processes; tensor parallelism is "
            "supported on a mesh of the whole world (TP alone, or a (dp, tp) mesh with FSDP2 over dp)"
        )


def replicated_layer(module: nn.Module, own: Dict[str, Any], managed: Any) -> bool:
    """Whether every parameter of ``module`` is a tensor-parallel DTensor replicated over the group (torch's
    ``SequenceParallel`` makes its norms so): each rank computes with the whole weights."""
    from torch.distributed.tensor import Replicate

    params = dict(module.named_parameters(recurse=False))
    if set(own) != set(params):
        return False
    for p in params.values():
        mesh_dim = _tensor_parallel_dim(p, managed)
        if mesh_dim == 0 and (p.device_mesh.ndim != 1 or len(p.placements) != 1):
            return False
        if not isinstance(p.placements[mesh_dim], Replicate):
            return False
    return True


def check_sharding(module: nn.Module) -> Dict[nn.Parameter, Any]:
    """Refuse, before anything is attached, DTensor parameters private training cannot keep exact;
    the tensor-parallel layouts of the parameters (empty without tensor parallelism).

    FSDP2's (and HSDP's) shards are gathered for their layer's call; a tensor-parallel slice is not
    (each rank computes with its slice, so one sample's gradient is split across the ranks), and
    only the splits whose partial norms can be added up are accepted: tensor parallelism alone, or on
    the second dim of a (dp, tp) mesh whose first dim FSDP2 shards.
    """
    check_transformers_styles(module)
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad and is_sharded(p)]
    if not named:
        return {}
    managed = fully_shard_params(module)
    layouts = tensor_parallel_params(module, managed)
    alone = [name for name, p in named if p in layouts and not layouts[p].with_fsdp]
    if alone and len(alone) < len(named):
        shown = ", ".join(alone[:4]) + (f" and {len(alone) - 4} more" if len(alone) > 4 else "")
        raise ValueError(
            f"parameters {shown} are tensor-parallel DTensors that fully_shard does not manage, in a model FSDP2 "
            "shards too: apply fully_shard to the whole model after parallelize_module, on the dp dim of one "
            "(dp, tp) mesh (the TP x FSDP2 recipe), or use tensor parallelism alone"
        )
    mesh = next(iter(layouts.values())).mesh if layouts else None
    for name, p in named:
        if p in layouts:
            continue
        if mesh is not None and mesh.ndim == 2:  # TP x FSDP2: the other parameters are FSDP2's over dp
            ranks = torch.distributed.get_process_group_ranks
            if p.device_mesh.ndim != 1 or ranks(p.device_mesh.get_group(0)) != ranks(mesh.get_group(0)):
                raise ValueError(f"parameter {name} is sharded over another mesh than the tensor-parallel layers' "
                                 "data-parallel dim; apply fully_shard on that dim (mesh['dp'])")
        shard_layout(p, name)  # refuses placements other than FSDP2's and HSDP's
    return layouts


#: transformers' own tensor-parallel styles (``transformers.distributed.tensor_parallel``) whose slices the
#: rules here cover; any other (``ReplicatedWithGradAllReduce``: a replicated norm weight whose per-sample
#: gradient is partial on every rank; ``SequenceParallel``; packed and expert styles) is refused.
_TRANSFORMERS_STYLES = {"ColwiseParallel", "RowwiseParallel", "EmbeddingParallel"}


def _made_by_a_style(fn: Any) -> bool:
    return ".install_forward." in str(getattr(fn, "__qualname__", "")) and str(getattr(fn, "__module__", "")).startswith("transformers.")


def transformers_style(module: nn.Module) -> Optional[Any]:
    """The transformers tensor-parallel style on ``module`` (which transformers marks ``_is_hooked`` and
    whose ``forward`` it replaces by the style's wrapper, or, for some styles from transformers 5.25 on,
    hooks with a forward pre-hook): the style object where the wrapper holds it, else the name of the
    class whose ``install_forward`` made the wrapper (or the pre-hook); None for a layer it did not touch."""
    forward = vars(module).get("forward")
    qualname = str(getattr(forward, "__qualname__", ""))
    made_by_a_style = _made_by_a_style(forward)
    if not (vars(module).get("_is_hooked") is True or made_by_a_style):
        return None
    if not made_by_a_style:
        hook = next((h for h in module._forward_pre_hooks.values() if _made_by_a_style(h)), None)
        if hook is not None:
            return str(hook.__qualname__).split(".", 1)[0]
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if any(klass.__name__ == "TensorParallelLayer" for klass in type(value).__mro__):
            return value
    return qualname.split(".", 1)[0] if ".install_forward." in qualname else "an unknown style"


def _style_name(style: Any) -> str:
    return style if isinstance(style, str) else type(style).__name__


def _split_kind(module: nn.Module) -> Optional[str]:
    """``"linear"`` or ``"embedding"`` for a layer whose slices the rules here cover, else None."""
    style = transformers_style(module)
    if style is not None and (isinstance(style, str) or type(style).__name__ not in _TRANSFORMERS_STYLES
                              or style.should_use_local_tensors(module) or getattr(style, "shard_dim", 0) != 0):
        return None
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:  # FSDP2's FSDPLinear too
        return "linear"
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
        return None if module.scale_grad_by_freq or module.max_norm is not None else "embedding"
    return None


#: transformers' style for a replicated weight whose gradient each rank holds only part of (Qwen3's
#: per-head q/k norms see this rank's heads): its per-sample gradients are summed over the group
#: before any norm is formed (``partial_gradient_params``).
_PARTIAL_GRADIENT_STYLE = "ReplicatedWithGradAllReduce"


def partial_gradient_params(module: nn.Module) -> List[nn.Parameter]:
    """The plain parameters of layers under transformers' ``ReplicatedWithGradAllReduce``: each rank
    forms part of every sample's gradient (its heads'); the parts are summed over the group."""
    found = []
    for sub in module.modules():
        if _style_name(transformers_style(sub) or "") == _PARTIAL_GRADIENT_STYLE:
            found.extend(p for p in sub.parameters(recurse=False) if p.requires_grad and not is_sharded(p))
    return found


def sum_partial_gradients(grads: Dict[nn.Parameter, torch.Tensor], params: Sequence[nn.Parameter], group: Any) -> List[nn.Parameter]:
    """Sum, in place and in one collective, the per-sample gradients of ``params`` over ``group``; the
    parameters summed."""
    held = [p for p in params if p in grads]  # (a dict lookup: by identity)
    if not held:
        return held
    values = [grads[p].float() for p in held]
    collective_into(values, list(range(len(held))), lambda flat: torch.distributed.all_reduce(flat, group=group))
    for p, value in zip(held, values):
        grads[p] = value.to(grads[p].dtype)
    return held


def check_transformers_styles(module: nn.Module) -> None:
    """Refuse transformers' tensor-parallel styles the rules here do not cover, on layers of any kind."""
    for name, sub in module.named_modules():
        style = transformers_style(sub)
        if style is None or _split_kind(sub) is not None:
            continue
        if _style_name(style) == _PARTIAL_GRADIENT_STYLE and not any(is_sharded(p) for p in sub.parameters()):
            continue  # its per-sample gradients are summed over the group (partial_gradient_params)
        raise ValueError(
            f"{name or type(module).__name__} ({type(sub).__name__}) runs under transformers' tensor-parallel style "
            f"{_style_name(style)}, which private training has no rule for. Use a tensor-parallel plan of column- "
            "and row-wise Linear layers, row-split embeddings and replicated layers (tp_plan entries colwise / "
            "rowwise / embedding_rowwise / replicated_with_grad_allreduce), or no tensor parallelism"
        )


def torch_style_hooks(module: nn.Module, outputs: bool) -> bool:
    """Whether torch's tensor-parallel styles (``parallelize_module``: ColwiseParallel, RowwiseParallel,
    SequenceParallel, PrepareModuleInput / Output) hooked ``module``'s inputs (``outputs``: its output)."""
    hooks = module._forward_hooks if outputs else module._forward_pre_hooks
    return any(str(getattr(hook, "__module__", "")).startswith("torch.distributed.tensor") for hook in hooks.values())


def whole_on_every_rank(module: nn.Module, layout: TensorParallelLayout, activations: Sequence[torch.Tensor],
                        backprops: torch.Tensor) -> bool:
    """Whether this call of a split layer yields each sample's *whole* gradient on every rank (from full
    inputs and output gradients: a row-split embedding, a column-split Linear whose output is gathered,
    a row-split Linear fed its whole input) rather than this rank's slice of it; refused when the
    shapes say neither."""
    if _split_kind(module) == "embedding":
        return True
    local = layout.end - layout.start
    width = backprops.shape[-1] if layout.dim == 0 else activations[0].shape[-1]
    full = layout.shape[layout.dim]
    if width == local and local != full:
        return False
    if width == full:
        return True
    raise ValueError(f"a tensor-parallel {type(module).__name__}'s {'output gradient' if layout.dim == 0 else 'input'} "
                     f"is {width} wide: neither its slice ({local}) nor its whole ({full})")


def _layout(param: Any, dim: Optional[int], mesh_dim: int, name: str) -> TensorParallelLayout:
    mesh = param.device_mesh
    group, rank, world = mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim)
    shape, with_fsdp = tuple(param.shape), mesh_dim == 1
    if dim is None:
        return TensorParallelLayout(mesh, group, rank, world, shape, None, with_fsdp=with_fsdp)
    per_rank = -(-shape[dim] // world)  # DTensor's Shard: torch.chunk semantics
    start, end = min(rank * per_rank, shape[dim]), min((rank + 1) * per_rank, shape[dim])
    layout = TensorParallelLayout(mesh, group, rank, world, shape, dim, start, end, with_fsdp)
    if not with_fsdp and tuple(param.to_local().shape) != layout.local_shape:
        raise ValueError(f"{name}: the local slice has shape {tuple(param.to_local().shape)}, not the "
                         f"{layout.local_shape} of an even split of dim {dim} over {world} ranks; not supported")
    return layout


def tensor_parallel_group(layouts: Dict[nn.Parameter, TensorParallelLayout]) -> Any:
    """The process group of the ranks that split the layers (and run one batch); one mesh is supported."""
    return next(iter(layouts.values())).group


def data_parallel_group(layouts: Dict[nn.Parameter, TensorParallelLayout]) -> Any:
    """The group over which the Poisson draws are sharded: True (the world) without tensor parallelism,
    None under tensor parallelism alone (every rank the same batch), the dp group under TP x FSDP2."""
    if not layouts:
        return True
    layout = next(iter(layouts.values()))
    return layout.mesh.get_group(0) if layout.with_fsdp else None


def data_parallel_shard_layout(param: Any, layout: TensorParallelLayout) -> ShardLayout:
    """TP x FSDP2: where this rank's FSDP2 shard lies in its tensor-parallel slice (rows of dim 0 over dp),
    the layout the sharded accumulator and its reduce-scatter over the dp group use."""
    mesh = param.device_mesh
    group, rank, world = mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0)
    shape = layout.local_shape
    per_rank = -(-shape[0] // world)
    start, end = min(rank * per_rank, shape[0]), min((rank + 1) * per_rank, shape[0])
    dp = ShardLayout(group, rank, world, shape, per_rank, start, end)
    if tuple(param.to_local().shape) != dp.local_shape:
        raise ValueError(f"a TP x FSDP2 parameter's local shard has shape {tuple(param.to_local().shape)}, not the "
                         f"{dp.local_shape} of an even dim-0 split of its tensor-parallel slice; not supported")
    return dp


def local_part(t: Any, batch_dim: Optional[int], features_split: bool = True) -> Any:
    """A layer input or output gradient as this rank computed with it: a DTensor's local tensor. It must
    be replicated, or (``features_split``: a Linear's) split along its last dim, the features, never
    along the batch (``batch_dim``) or the tokens: a token-split input would hold part of every
    sample's rows on each rank."""
    if not is_sharded(t):
        return t
    from torch.distributed.tensor import Replicate, Shard

    for placement in t.placements:
        last = type(placement) is Shard and placement.dim % t.dim() == t.dim() - 1
        whole = isinstance(placement, Replicate) or (features_split and last and batch_dim != t.dim() - 1)
        if not whole:
            raise ValueError(
                f"a tensor-parallel layer's input or output gradient is a DTensor with placements {tuple(t.placements)}: "
                f"only a replicated one, or a Linear's split of its last dim (the features), keeps every sample's rows "
                f"(the batch is dim {batch_dim}) whole on every rank"
            )
    return t.to_local()


def token_split_part(t: Any, batch_dim: Optional[int], feature_dims: int) -> Tuple[Any, Optional[int]]:
    """A replicated layer's input or output gradient as this rank computed with it, and the dim of the tokens
    it holds a slice of (None: whole). Under ``SequenceParallel`` each rank holds every sample's rows for its
    slice of the tokens (``Shard`` of a dim that is neither the batch nor one of the last ``feature_dims``,
    which the layer's weights act on); anything else but a replicated tensor is refused."""
    if not is_sharded(t):
        return t, None
    from torch.distributed.tensor import Replicate, Shard

    split = None
    for placement in t.placements:
        if isinstance(placement, Replicate):
            continue
        dim = placement.dim % t.dim() if type(placement) is Shard else None
        if dim is None or dim == batch_dim or dim >= t.dim() - feature_dims or split is not None:
            raise ValueError(
                f"a tensor-parallel layer with replicated weights has an input or output gradient with placements "
                f"{tuple(t.placements)}: only a replicated one, or one split along the tokens (SequenceParallel: "
                f"neither the batch, dim {batch_dim}, nor one of the last {feature_dims}, as many as its weights have), "
                "gives each rank whole rows of every sample"
            )
        split = dim
    return t.to_local(), split


def local_shape(t: Any) -> torch.Size:
    """The shape of the tensor this rank holds (a DTensor's local one)."""
    return t.to_local().shape if is_sharded(t) else t.shape


def complete_norms(norms: Dict[nn.Parameter, torch.Tensor], layouts: Dict[nn.Parameter, TensorParallelLayout],
                   whole: Any = ()) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample norms of the whole parameters, the same on every rank, in one collective: a split
    parameter's partial squared norms summed over the group, every other parameter's (and a split one's
    computed whole on every rank, ``whole``) taken from rank 0, so the clip factors agree."""
    if not norms:
        return norms
    group = tensor_parallel_group(layouts)
    first = torch.distributed.get_rank(group) == 0
    params = list(norms)
    squares = torch.stack([norms[p].float() ** 2 for p in params])
    for row, p in enumerate(params):
        partial = p in layouts and layouts[p].sharded and p not in whole
        if not partial and not first:
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
    """Write ``p.grad = (clipped sum + noise) / expected batch size`` on every rank.

    The noise of parameter ``i`` is element-wise the one-process stream of ``ShardedNoise`` (global
    rank 0's key, broadcast): a split parameter takes its slice of it on each rank (under TP x FSDP2,
    the rows of its FSDP2 shard within the slice; secure noise: each rank draws its own elements,
    one draw per element). Every other parameter (replicated over the tensor-parallel group, plain,
    or FSDP2's over dp) gets the clipped sum and noise of its group's rank 0, broadcast over the
    tensor-parallel group: the same gradient on every rank of it.
    """
    dist = torch.distributed
    noise = sharded_noise(optimizer)
    std = optimizer.noise_std
    group = tensor_parallel_group(layouts)
    key = noise.step_key() if std > 0 else None
    if key is not None:  # one stream: global rank 0's key, whatever the others drew
        box = [key]
        dist.broadcast_object_list(box, src=0)
        key = int(box[0])
    sharded = shard_layouts(optimizer, [p for p in params if is_sharded(p) and (p not in layouts or layouts[p].with_fsdp)])
    locals_: List[torch.Tensor] = []
    whole: List[int] = []
    for index, p in enumerate(params):
        layout, shard = layouts.get(p), sharded.get(p)
        split = layout is not None and layout.sharded
        value = p.to_local() if is_sharded(p) else p
        held = optimizer._summed.get(p)
        local = (held.reshape(value.shape).float().clone() if held is not None
                 else torch.zeros(value.shape, dtype=torch.float32, device=value.device))
        if std > 0 and split and noise.secure:
            local.view(-1).add_(noise.slice(None, index, local.numel(), 0, local.numel(), std, device=local.device))
        elif std > 0 and split:
            full = noise.slice(key, index, p.numel(), 0, p.numel(), std, device=local.device).view(layout.shape)
            piece = layout.local_of(full)
            if shard is not None:  # TP x FSDP2: this rank's rows of its slice
                piece = piece.narrow(0, shard.row_start, shard.row_end - shard.row_start)
            local.add_(piece)
        elif std > 0:
            start, end = shard.element_range if shard is not None else (0, p.numel())
            local.view(-1).add_(noise.slice(key, index, p.numel(), start, end, std, device=local.device))
        if not split:
            whole.append(index)
        locals_.append(local)
    if whole:  # the tensor-parallel group's rank 0's clipped sum and noise everywhere in the group
        source = dist.get_global_rank(group, 0)
        collective_into(locals_, whole, lambda flat: dist.broadcast(flat, src=source, group=group))
    write_noised_grads(optimizer, params, locals_)


class TensorParallelSlices:
    """The DP optimizer's gradient writer (``dptorch.optim.gradient_writer``) under tensor parallelism: each rank
    keeps its slice of the clipped sums whole (under TP x FSDP2, ``sharded``: reduce-scattered over dp as FSDP2's
    shards are), and writes its slice of the noised gradient (``add_noise_tensor_parallel``)."""

    def __init__(self, layouts: Dict[nn.Parameter, TensorParallelLayout], sharded: bool) -> None:
        self.layouts = layouts
        self.sharded = ShardedParameters() if sharded else None

    def keep(self, optimizer: Any, hooks: Any, factors: Dict[nn.Parameter, torch.Tensor],
             dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
        return self.sharded.keep(optimizer, hooks, factors, dropped) if self.sharded is not None else factors

    def write(self, optimizer: Any, params: Sequence[nn.Parameter]) -> None:
        add_noise_tensor_parallel(optimizer, params, self.layouts)


__all__ = [
    "TensorParallelLayout",
    "TensorParallelSlices",
    "add_noise_tensor_parallel",
    "check_sharding",
    "check_transformers_styles",
    "check_same_batch",
    "complete_norms",
    "context_parallel_active",
    "data_parallel_group",
    "data_parallel_shard_layout",
    "local_part",
    "local_shape",
    "partial_gradient_params",
    "replicated_layer",
    "sum_partial_gradients",
    "tensor_parallel_group",
    "tensor_parallel_params",
    "token_split_part",
    "torch_style_hooks",
    "transformers_style",
    "whole_on_every_rank",
]
