"""Registries that map module types to per-sample gradient functions.

A grad sampler is a pure function ``(module, activations, backprops) -> {param: grad_sample}``:
``activations`` is the tuple of tensor inputs of one call of ``module`` (batch first),
``backprops`` the gradient of the loss with respect to that call's output (batch first,
already scaled so that row ``i`` is the gradient of sample ``i``'s loss). It returns, for each
direct parameter of ``module`` that requires grad, a tensor of shape ``(batch, *param.shape)``.

Lookup order: exact type, then along the type's MRO (a subclass of ``nn.Linear`` uses the
``nn.Linear`` sampler), then duck-typed rules (predicates over the module instance, such as the
HF RMSNorm family). Registration may happen at any time before a controller attaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import torch
from torch import nn

GradSampler = Callable[[nn.Module, Tuple[torch.Tensor, ...], torch.Tensor], Dict[nn.Parameter, torch.Tensor]]
ModulePredicate = Callable[[nn.Module], bool]

_GRAD_SAMPLERS: Dict[Type[nn.Module], GradSampler] = {}
_DUCK_RULES: List[Tuple[ModulePredicate, GradSampler, Optional[ModulePredicate]]] = []
_VERIFIED: Dict[Tuple[Type[nn.Module], GradSampler], bool] = {}


def register_grad_sampler(*module_types: Type[nn.Module]):
    """Decorator registering a grad sampler for one or more module types."""
    if not module_types:
        raise TypeError("register_grad_sampler needs at least one module type")

    def decorator(fn: GradSampler) -> GradSampler:
        for module_type in module_types:
            _GRAD_SAMPLERS[module_type] = fn
        return fn

    return decorator


def register_duck_grad_sampler(predicate: ModulePredicate, *, verify: Optional[ModulePredicate] = None):
    """Decorator registering a grad sampler for every module for which ``predicate`` is true.

    Duck rules are consulted only when no registered type matches, in registration order.
    ``verify(module)``, if given, checks the sampler numerically on one instance of each class;
    a class that fails it gets no sampler from this rule (the torch.func fallback then applies).
    """

    def decorator(fn: GradSampler) -> GradSampler:
        _DUCK_RULES.append((predicate, fn, verify))
        return fn

    return decorator


def find_grad_sampler(module: nn.Module) -> Optional[GradSampler]:
    """The sampler for ``module``: exact type, then MRO, then duck rules; None if none."""
    return _lookup(_GRAD_SAMPLERS, _DUCK_RULES, module)


def _lookup(table: Dict[Type[nn.Module], Any], duck_rules: list, module: nn.Module) -> Any:
    """The entry for the module's type or nearest registered base class, else the first duck
    rule that matches (and, if it has a check, passes it for this class); None if none."""
    _load_builtin_samplers()
    for cls in type(module).__mro__:
        if cls in table:
            return table[cls]
        if cls is nn.Module:
            break
    for predicate, entry, verify in duck_rules:
        if predicate(module) and _verified(module, entry, verify):
            return entry
    return None


def _verified(module: nn.Module, fn: Any, verify: Optional[ModulePredicate]) -> bool:
    if verify is None:
        return True
    key = (type(module), fn)
    if key not in _VERIFIED:
        _VERIFIED[key] = bool(verify(module))
    return _VERIFIED[key]


NormFunction = Callable[[nn.Module, Tuple[torch.Tensor, ...], torch.Tensor], Dict[nn.Parameter, torch.Tensor]]


@dataclass(frozen=True)
class NormSampler:
    """Per-sample squared norms, and batch gradients from per-sample scaled backprops.

    ``token_wise`` layers act on each position of ``(B, *middle, F)`` independently, so the rows
    of one privacy unit can be concatenated along the middle dimensions. ``linear_form``, if
    given, returns the weight's per-sample gradient as factors ``sum_t left_t (x) right_t`` so that
    a weight shared with another layer (tied embeddings) needs no instantiation either.
    """

    norms_sq: NormFunction
    clipped_sum: NormFunction
    token_wise: bool = False
    linear_form: Optional[Callable] = None


_NORM_SAMPLERS: Dict[Type[nn.Module], NormSampler] = {}
_NORM_DUCK_RULES: List[Tuple[ModulePredicate, NormSampler, None]] = []


def register_norm_sampler(
    *module_types: Type[nn.Module],
    clipped_sum: NormFunction,
    predicate: Optional[ModulePredicate] = None,
    token_wise: bool = False,
    linear_form: Optional[Callable] = None,
):
    """Decorator registering ``norms_sq(module, activations, backprops)`` for ghost/BK modes.

    ``clipped_sum(module, activations, scaled_backprops)`` must return the batch gradient of each
    trainable direct parameter given backprops already multiplied by each sample's clip factor.
    Give module types, or a ``predicate`` for duck-typed families.
    """
    if not module_types and predicate is None:
        raise TypeError("register_norm_sampler needs module types or a predicate")

    def decorator(fn: NormFunction) -> NormFunction:
        sampler = NormSampler(fn, clipped_sum, token_wise, linear_form)
        for module_type in module_types:
            _NORM_SAMPLERS[module_type] = sampler
        if predicate is not None:
            _NORM_DUCK_RULES.append((predicate, sampler, None))
        return fn

    return decorator


def find_norm_sampler(module: nn.Module) -> Optional[NormSampler]:
    """The norm sampler for ``module`` (type, MRO, then duck rules), or None."""
    return _lookup(_NORM_SAMPLERS, _NORM_DUCK_RULES, module)


def _load_builtin_samplers() -> None:
    """Import the built-in layer and norm samplers once (they register themselves)."""
    from dptorch.grad_sample import ghost, layers  # noqa: F401  (import registers)
