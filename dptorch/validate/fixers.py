"""Fixers: functions that turn an incompatible module into a compatible one.

A fixer is ``fixer(module, **options) -> nn.Module``, registered for module types (and their
subclasses) with ``register_module_fixer``. It receives a module of the deep copy that
``ModuleValidator.fix`` works on, so it may modify it or return a new module; weights and
``requires_grad`` flags must carry over. Its keyword-only arguments are the options users may
pass to ``fix``. Built-in fixers: BatchNorm to GroupNorm (or InstanceNorm), InstanceNorm without
running statistics, torch's RNN/GRU/LSTM to the DP layers, MultiheadAttention to
DPMultiheadAttention, Embedding/EmbeddingBag with ``max_norm`` to ones that renormalise every row.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Set, Type

import torch
from torch import nn

from dptorch.grad_sample.layers.embedding import renormalising_every_row
from dptorch.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention

ModuleFixer = Callable[..., nn.Module]
_FIXERS: Dict[Type[nn.Module], ModuleFixer] = {}

MAX_GROUPS = 32
BATCHNORM_REPLACEMENTS = ("groupnorm", "instancenorm")


def register_module_fixer(*module_types: Type[nn.Module]):
    """Decorator registering ``fixer(module, **options) -> nn.Module`` for module types.

    A single list or tuple of types is accepted too (Opacus' ``register_module_fixer([A, B])``).
    """
    if len(module_types) == 1 and isinstance(module_types[0], (list, tuple)):
        module_types = tuple(module_types[0])
    if not module_types:
        raise TypeError("register_module_fixer needs at least one module type")

    def decorator(fn: ModuleFixer) -> ModuleFixer:
        for module_type in module_types:
            _FIXERS[module_type] = fn
        return fn

    return decorator


def find_module_fixer(module: nn.Module) -> Optional[ModuleFixer]:
    """The fixer for ``module``'s type, else for its nearest registered base class; None if none."""
    for cls in type(module).__mro__:
        if cls in _FIXERS:
            return _FIXERS[cls]
    return None


def fixer_options(fixer: ModuleFixer) -> Optional[Set[str]]:
    """The option names ``fixer`` accepts (None: any, it takes ``**kwargs``)."""
    params = list(inspect.signature(fixer).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}


def known_options() -> Optional[Set[str]]:
    """Every option some registered fixer accepts (None: a fixer accepts any)."""
    names: Set[str] = set()
    for fixer in set(_FIXERS.values()):
        accepted = fixer_options(fixer)
        if accepted is None:
            return None
        names |= accepted
    return names


def apply_fixer(fixer: ModuleFixer, module: nn.Module, options: Dict[str, Any]) -> nn.Module:
    """Call ``fixer`` with the subset of ``options`` it accepts."""
    accepted = fixer_options(fixer)
    return fixer(module, **{k: v for k, v in options.items() if accepted is None or k in accepted})


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is ``<= limit`` (the GroupNorm group count for ``n`` channels)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _factory_of(module: nn.Module) -> Dict[str, Any]:
    tensor = next(iter(module.parameters()), None)
    if tensor is None:
        tensor = next(iter(module.buffers()), None)
    return {} if tensor is None else dict(device=tensor.device, dtype=tensor.dtype)


def _copy_parameter(source: Optional[nn.Parameter], target: Optional[nn.Parameter]) -> None:
    if source is not None and target is not None:
        with torch.no_grad():
            target.copy_(source)
        target.requires_grad_(source.requires_grad)


def _instance_norm_type(module: nn.Module) -> Optional[Type[nn.Module]]:
    for batch_norm, instance_norm in (
        (nn.BatchNorm1d, nn.InstanceNorm1d), (nn.BatchNorm2d, nn.InstanceNorm2d), (nn.BatchNorm3d, nn.InstanceNorm3d)
    ):
        if isinstance(module, batch_norm):
            return instance_norm
    return None


@register_module_fixer(nn.modules.batchnorm._BatchNorm)
def replace_batch_norm(module: nn.modules.batchnorm._BatchNorm, *, batchnorm: str = "groupnorm",
                       num_groups: Optional[int] = None, replace_bn_with_in: bool = False) -> nn.Module:
    """BatchNorm (any dim, SyncBatchNorm) to GroupNorm whose group count is the largest divisor of the
    channels up to 32 (or ``num_groups``, which must divide them); with ``batchnorm="instancenorm"``
    (Opacus: ``replace_bn_with_in=True``), to InstanceNorm1d/2d/3d without running
    statistics (for SyncBatchNorm, whose dim is unknown, GroupNorm with one group per channel, which
    is instance normalisation). Affine weights carry over; running statistics are dropped."""
    batchnorm = "instancenorm" if replace_bn_with_in else batchnorm
    if num_groups is not None and (batchnorm != "groupnorm" or not isinstance(num_groups, int) or num_groups < 1
                                   or module.num_features % num_groups):
        raise ValueError(f"num_groups={num_groups!r} must be a whole divisor of the {module.num_features} channels of "
                         f"{type(module).__name__}, for the GroupNorm replacement")
    if batchnorm not in BATCHNORM_REPLACEMENTS:
        raise ValueError(f"batchnorm must be one of {BATCHNORM_REPLACEMENTS}, got {batchnorm!r}")
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError("cannot fix an uninitialised lazy BatchNorm: run one forward pass first")
    channels, factory = module.num_features, _factory_of(module)
    instance_norm = _instance_norm_type(module) if batchnorm == "instancenorm" else None
    if instance_norm is not None:
        fixed: nn.Module = instance_norm(channels, eps=module.eps, affine=module.affine, track_running_stats=False, **factory)
    else:
        groups = channels if batchnorm == "instancenorm" else num_groups or largest_divisor_at_most(channels, MAX_GROUPS)
        fixed = nn.GroupNorm(groups, channels, eps=module.eps, affine=module.affine, **factory)
    _copy_parameter(module.weight, fixed.weight)
    _copy_parameter(module.bias, fixed.bias)
    return fixed.train(module.training)


@register_module_fixer(nn.Embedding, nn.EmbeddingBag)
def renormalise_every_row(module: nn.Module) -> nn.Module:
    """Embedding/EmbeddingBag with ``max_norm`` to RenormedEmbedding/RenormedEmbeddingBag, which
    renormalise every row before each lookup, not only the looked-up ones (same parameter object).
    A subclass is left as it is (it stays reported): swapping its class would lose its forward."""
    return renormalising_every_row(module)


@register_module_fixer(nn.modules.instancenorm._InstanceNorm)
def disable_running_stats(module: nn.modules.instancenorm._InstanceNorm) -> nn.Module:
    """InstanceNorm that normalises with each sample's own statistics and keeps none."""
    module.track_running_stats = False
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        module.register_buffer(name, None)
    return module


_DP_RECURRENT = ((nn.LSTM, DPLSTM), (nn.GRU, DPGRU), (nn.RNN, DPRNN))


@register_module_fixer(nn.RNN, nn.GRU, nn.LSTM)
def replace_recurrent(module: nn.RNNBase) -> nn.Module:
    """torch's RNN/GRU/LSTM to DPRNN/DPGRU/DPLSTM with the same configuration and weights."""
    dp_type = next(dp for torch_type, dp in _DP_RECURRENT if isinstance(module, torch_type))
    config: Dict[str, Any] = dict(
        num_layers=module.num_layers, bias=module.bias, batch_first=module.batch_first,
        dropout=module.dropout, bidirectional=module.bidirectional, **_factory_of(module),
    )
    if dp_type is DPLSTM:
        config["proj_size"] = module.proj_size
    if dp_type is DPRNN:
        config["nonlinearity"] = module.nonlinearity
    fixed = dp_type(module.input_size, module.hidden_size, **config)
    fixed.load_state_dict(module.state_dict())
    for name, param in module.named_parameters():
        getattr(fixed, name).requires_grad_(param.requires_grad)
    return fixed.train(module.training)


@register_module_fixer(nn.MultiheadAttention)
def replace_multihead_attention(module: nn.MultiheadAttention) -> nn.Module:
    """``nn.MultiheadAttention`` to DPMultiheadAttention with the same configuration and weights."""
    fixed = DPMultiheadAttention(
        module.embed_dim, module.num_heads, dropout=module.dropout, bias=module.in_proj_bias is not None,
        add_bias_kv=module.bias_k is not None, add_zero_attn=module.add_zero_attn, kdim=module.kdim,
        vdim=module.vdim, batch_first=module.batch_first, **_factory_of(module),
    )
    fixed.load_state_dict(module.state_dict())
    sources = dict(module.named_parameters())
    for name, param in fixed.named_parameters():
        param.requires_grad_(sources[_torch_attention_name(name, module._qkv_same_embed_dim)].requires_grad)
    return fixed.train(module.training)


def _torch_attention_name(name: str, fused: bool) -> str:
    """The ``nn.MultiheadAttention`` parameter a DPMultiheadAttention parameter comes from."""
    projection, _, part = name.partition(".")
    if projection in ("q_proj", "k_proj", "v_proj"):
        return f"in_proj_{part}" if fused or part == "bias" else f"{projection}_weight"
    return {"key_bias.weight": "bias_k", "value_bias.weight": "bias_v"}.get(name, name)
