"""Reading an operation's arguments: positional or keyword, dims normalised; and ``Tracker``, the name
the rules give the tracker that runs them."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

#: The ``BatchTracker`` (``mode.py``) that runs a rule, as the rules and the files below ``mode.py`` name it:
#: ``mode.py`` imports them, so none of them imports it, not even for type checking.
Tracker = Any

def arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def dims_arg(value: Any, ndim: int) -> Optional[Tuple[int, ...]]:
    """A ``dim`` argument as normalised dims; None means all dims."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(norm_dim(int(v), max(ndim, 1)) for v in value) if len(value) else None
    return (norm_dim(int(value), max(ndim, 1)),)


def shape_args(args: tuple, start: int) -> Tuple[int, ...]:
    rest = args[start:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        return tuple(rest[0])
    return tuple(rest)


def tensors_of(args: tuple, kwargs: dict):
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            yield ("a", i), a
    for k, a in kwargs.items():
        if isinstance(a, Tensor) and k != "out":  # out= is written, not read (mode.py checks the write)
            yield ("k", k), a


def any_tensor(args: tuple, kwargs: dict, test: Callable[[Tensor], bool]) -> bool:
    """Whether ``test`` holds for a tensor argument, or a tensor in a list argument, of an operation."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            if test(a):
                return True
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor) and test(b):
                    return True
    return False


def replace_arg(args: tuple, kwargs: dict, where, value):
    if where[0] == "a":
        args = args[: where[1]] + (value,) + args[where[1] + 1 :]
    else:
        kwargs = dict(kwargs)
        kwargs[where[1]] = value
    return args, kwargs


def op_name(func) -> str:
    return getattr(func, "__name__", repr(func))


_DISPATCH = ("dptorch.grad_sample.tracking", "torch.overrides", "torch._tensor")


def caller() -> str:
    """The module of the code that called the torch operation being followed: the first frame outside
    torch's dispatch and this tracker."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_DISPATCH):
            return module
        frame = frame.f_back
    return ""


def is_library(module: str) -> bool:
    """Whether ``module`` is this library's own code (its losses, checks and optimizer), not a user's: its
    examples are a user's code."""
    return module.startswith("dptorch.") and not module.startswith("dptorch.cli.examples")
