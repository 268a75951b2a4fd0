"""Rules that find modules incompatible with per-sample gradients, each with its fix.

A rule is ``check(module) -> Optional[str]`` registered for module types with
``register_module_check``; it returns why the module is incompatible and how to fix it, or None.
``ModuleValidator`` (``dptorch.validate``) and the attach-time check of ``GradSampleHooks`` both
read this registry, so a rule registered once is enforced everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Type

from torch import nn

ModuleCheck = Callable[[nn.Module], Optional[str]]
_CHECKS: Dict[Type[nn.Module], List[ModuleCheck]] = {}


@dataclass(frozen=True)
class Incompatibility:
    """One incompatible module: where it is, why, and the fix."""

    path: str
    module_type: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'} ({self.module_type}): {self.reason}"


def register_module_check(*module_types: Type[nn.Module]):
    """Decorator registering a compatibility rule for the given module types (and subclasses)."""

    def decorator(fn: ModuleCheck) -> ModuleCheck:
        for module_type in module_types:
            _CHECKS.setdefault(module_type, []).append(fn)
        return fn

    return decorator


def incompatibilities(model: nn.Module) -> List[Incompatibility]:
    """Every incompatible module of ``model``, in module order."""
    found = []
    for path, module in model.named_modules():
        for module_type, checks in _CHECKS.items():
            if isinstance(module, module_type):
                for check in checks:
                    reason = check(module)
                    if reason:
                        found.append(Incompatibility(path, type(module).__name__, reason))
    return found


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


@register_module_check(nn.modules.batchnorm._BatchNorm)
def _batch_norm(module: nn.Module) -> Optional[str]:
    return (
        "batch normalisation mixes the samples of a batch, so no per-sample gradient exists; "
        "replace it with GroupNorm via model = dptorch.ModuleValidator.fix(model), then build the optimizer "
        "from the fixed model"
    )


@register_module_check(nn.modules.instancenorm._InstanceNorm)
def _instance_norm_running_stats(module: nn.Module) -> Optional[str]:
    if module.track_running_stats:
        return (
            "track_running_stats=True keeps running statistics computed from the data without privacy; "
            "set track_running_stats=False (dptorch.ModuleValidator.fix(model) does it)"
        )
    return None


@register_module_check(nn.RNNBase)
def _rnn(module: nn.Module) -> Optional[str]:
    if _trainable(module):
        kind = type(module).__name__
        return (
            f"torch's fused {kind} has no per-sample gradients; replace it with dptorch.layers.DP{kind} "
            "(model = ModuleValidator.fix(model) does it; then build the optimizer from the fixed model)"
        )
    return None


@register_module_check(nn.MultiheadAttention)
def _multihead_attention(module: nn.Module) -> Optional[str]:
    if _trainable(module):
        return (
            "nn.MultiheadAttention uses its weights inside a fused function; replace it with "
            "dptorch.layers.DPMultiheadAttention (ModuleValidator.fix does it)"
        )
    return None


@register_module_check(nn.Embedding, nn.EmbeddingBag)
def _renormalising_lookup(module: nn.Module) -> Optional[str]:
    if module.max_norm is None:
        return None
    leak = (
        f"max_norm={module.max_norm} renormalises, in place during forward, the rows that the batch looks up, so the "
        "weights record which indices (tokens) the private data held; "
    )
    if type(module) in (nn.Embedding, nn.EmbeddingBag):
        return leak + (
            "model = dptorch.ModuleValidator.fix(model) renormalises every row before each lookup instead (the same "
            "rows and gradients, independent of the data), then build the optimizer from the fixed model"
        )
    return leak + (
        "set max_norm=None and renormalise every row before each lookup in its forward "
        "(dptorch.grad_sample.layers.embedding.renormalise_every_row(self.weight, max_norm, self.norm_type))"
    )
