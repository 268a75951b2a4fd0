"""``opacus.utils.module_utils``: small helpers over a model's modules, parameters and state dicts."""

from __future__ import annotations

import io
from typing import Any, Iterator, Mapping, Tuple

import torch
from torch import nn


def has_trainable_params(module: nn.Module) -> bool:
    """Whether ``module`` has a direct parameter that requires a gradient."""
    return any(p.requires_grad for p in module.parameters(recurse=False))


def parametrized_modules(module: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``(name, submodule)`` of every submodule that has direct parameters."""
    return ((name, sub) for name, sub in module.named_modules() if any(True for _ in sub.parameters(recurse=False)))


def trainable_modules(module: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``(name, submodule)`` of every submodule with a direct parameter that requires a gradient."""
    return ((name, sub) for name, sub in module.named_modules() if has_trainable_params(sub))


def trainable_parameters(module: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter that requires a gradient."""
    return ((name, p) for name, p in module.named_parameters() if p.requires_grad)


def requires_grad(module: nn.Module, *, recurse: bool = False) -> bool:
    """Whether any parameter of ``module`` (its direct ones, or all with ``recurse``) requires a gradient."""
    return any(p.requires_grad for p in module.parameters(recurse=recurse))


def clone_module(module: nn.Module) -> nn.Module:
    """An independent copy of ``module`` through ``torch.save`` (which copies more modules than ``deepcopy``).

    It is unpickled (``weights_only=False``): clone only models you trust.
    """
    with io.BytesIO() as buffer:
        torch.save(module, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)


def get_submodule(module: nn.Module, target: str) -> nn.Module:
    """The submodule at the dotted path ``target`` (``""`` is ``module``); ``AttributeError`` if there is none."""
    return module.get_submodule(target)


def are_state_dict_equal(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """Whether two state dicts have the same keys and close (``torch.allclose``) values."""
    return first.keys() == second.keys() and all(
        torch.allclose(value, second[key]) for key, value in first.items())


__all__ = [
    "are_state_dict_equal",
    "clone_module",
    "get_submodule",
    "has_trainable_params",
    "parametrized_modules",
    "requires_grad",
    "trainable_modules",
    "trainable_parameters",
]
