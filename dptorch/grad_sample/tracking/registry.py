"""The registry of the batch tracker: operation name -> rule.

Each family in ``rules/`` holds a ``RULES`` table (name -> rule); this module merges them and finds
the rule of a torch function (its name, the ``F.`` form of ``torch.nn.functional``'s, a property
getter as ``get:<name>``, in-place variants). A rule is ``rule(tracker, func, args, kwargs)``: it
runs the operation through ``tracker.run`` and tags the outputs.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict

from dptorch.grad_sample.tracking import loss
from dptorch.grad_sample.tracking.rules import (
    convolution,
    elementwise,
    embedding,
    indexing,
    joins,
    linalg,
    losses,
    metadata,
    normalization,
    opaque,
    reductions,
    sequences,
    structural,
)
from dptorch.grad_sample.tracking.rules.elementwise import INPLACE_ALIASES, broadcast, inplace_rule
from dptorch.grad_sample.tracking.rules.metadata import skip
from dptorch.grad_sample.tracking.rules.opaque import UNFOLLOWED, default

__all__ = ["RULES", "UNFOLLOWED", "rule_of"]

RULES: Dict[str, Callable] = {}
for _family in (elementwise, metadata, reductions, structural, normalization, linalg, embedding, convolution, joins,
                indexing, opaque, sequences, losses, loss):
    RULES.update(_family.RULES)

_CACHE: Dict[Any, Callable] = {}


def rule_of(func) -> Callable:
    """The rule for ``func`` (cached per function object)."""
    rule = _CACHE.get(func)
    if rule is None:
        rule = _find(func)
        try:
            _CACHE[func] = rule
        except TypeError:
            pass
    return rule


def _find(func) -> Callable:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        key = "get:" + str(getattr(owner, "__name__", ""))
        return RULES.get(key) or skip
    if name is None:
        return default
    module = getattr(func, "__module__", None) or ""
    if module == "torch.nn.functional" and "F." + name in RULES:
        return RULES["F." + name]
    if name == "embedding" and module != "torch.nn.functional":
        return RULES["torch.embedding"]
    rule = RULES.get(name)
    if rule is not None:
        return rule
    if name in INPLACE_ALIASES:
        return partial(inplace_rule, INPLACE_ALIASES[name])
    if name.endswith("_") and not name.startswith("_") and RULES.get(name[:-1]) is broadcast:
        return partial(inplace_rule, name[:-1])
    return default
