"""The registry of the batch tracker: operation name -> rule.

Each family in ``rules/`` holds a ``RULES`` table (name -> rule); this module merges them and finds
the rule of a torch function (its name, the ``F.`` form of ``torch.nn.functional``'s, a property
getter as ``get:<name>``, in-place variants). A rule is ``rule(tracker, func, args, kwargs)``: it
runs the operation through ``tracker.run`` and tags the outputs.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Optional

from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket

from dptorch.grad_sample.tracking import loss
from dptorch.grad_sample.tracking.rules import (
    convolution,
    elementwise,
    embedding,
    escapes,
    indexing,
    joins,
    linalg,
    losses,
    metadata,
    normalization,
    opaque,
    quantized,
    reductions,
    sequences,
    structural,
)
from dptorch.grad_sample.tracking.args import norm_dim
from dptorch.grad_sample.tracking.rules.elementwise import INPLACE_ALIASES, broadcast, inplace_rule
from dptorch.grad_sample.tracking.rules.metadata import skip
from dptorch.grad_sample.tracking.rules.opaque import UNFOLLOWED, default
from dptorch.grad_sample.tracking.rules.structural import structural as structural_rule

__all__ = ["FAMILIES", "RULES", "UNFOLLOWED", "register_batch_rule", "remove_batch_rule", "rule_of"]

# family -> its rules (docs/privacy.md lists them, and a test keeps that list equal to this one)
FAMILIES: Dict[str, Dict[str, Callable]] = {
    _family.__name__.rsplit(".", 1)[1]: _family.RULES
    for _family in (elementwise, metadata, reductions, structural, normalization, linalg, embedding, convolution,
                    joins, indexing, opaque, sequences, losses, escapes, loss, quantized)
}
RULES: Dict[str, Callable] = {name: rule for rules in FAMILIES.values() for name, rule in rules.items()}

_CACHE: Dict[Any, Callable] = {}
_REGISTERED: Dict[Any, Callable] = {}  # rules users registered, by function object or custom op name


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
    if _REGISTERED:
        found = _registered(func)
        if found is not None:
            return found
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__"):  # a property of a tensor: get:data, set:data
        owner = getattr(func, "__self__", None)
        key = name[2:5] + ":" + str(getattr(owner, "__name__", ""))
        return RULES.get(key) or (skip if name == "__get__" else default)
    if name is None:
        return default
    module = getattr(func, "__module__", None) or ""
    if isinstance(func, (OpOverload, OpOverloadPacket)):
        return RULES.get(_qualified_name(func)) or default  # a custom operator's rule is keyed by ns::name
    if module and not module.startswith("torch"):
        return default  # an operator or library function whose semantics a torch name does not tell
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


def register_batch_rule(op: Any, kind: str = "elementwise", dim_map: Optional[Callable[..., Optional[int]]] = None) -> Any:
    """Tell the batch tracker that ``op`` is per-sample, so that a model using it trains instead of being refused.

    ``op``: a torch function or tensor method (``torch.special.erfcx``, ``torch.Tensor.frac_``), a
    custom operator (a ``torch.library.custom_op``, or ``torch.ops.ns.name``), or an operation's name.

    - ``kind="elementwise"``: each output element depends only on the elements of the (broadcast)
      inputs at its own position, so any batch dim carries over. An in-place ``op`` (a name ending
      in ``_``) writes into its first argument.
    - ``dim_map=f``: ``f(batch_dim, *args, **kwargs)``, called with the operation's own arguments,
      says where the batch dim ``batch_dim`` of the first tensor argument goes in the outputs (an
      int), or None where the operation mixes the samples along it (for ``torch.fft.fft``:
      ``lambda b, x, n=None, dim=-1, norm=None: None if dim % x.ndim == b else b``). Other tensor
      arguments must not derive from the batch unless batched as the first is.

    Registering an op that is not per-sample voids the privacy guarantee: only register what you
    know maps sample ``i``'s rows to sample ``i``'s rows. Returns ``op``; ``remove_batch_rule``
    undoes it.
    """
    if dim_map is not None:
        mapped = dim_map

        def dimfn(d, shape, args, kwargs, out):
            new = mapped(d, *args, **kwargs)
            ref = out if isinstance(out, Tensor) else out[0]
            return "mixes the samples, by its registered dim map" if new is None else norm_dim(int(new), ref.ndim)

        rule: Callable = structural_rule(dimfn, inplace=_inplace_name(op), writes=True, aligned="any")
    elif kind == "elementwise":
        name = _op_key(op) if isinstance(op, str) else getattr(op, "__name__", "")
        rule = partial(inplace_rule, name[:-1]) if _inplace_name(op) else broadcast
    else:
        raise ValueError(f"register_batch_rule: kind must be 'elementwise', or pass dim_map=; got kind={kind!r}")
    _REGISTERED[_op_key(op)] = rule
    _CACHE.clear()
    return op


def remove_batch_rule(op: Any) -> None:
    """Forget a rule ``register_batch_rule`` added for ``op``."""
    _REGISTERED.pop(_op_key(op), None)
    _CACHE.clear()


def _op_key(op: Any) -> Any:
    """What a registration is keyed by: a custom operator's qualified name, an op name, or the function."""
    if isinstance(op, str):
        return op
    qualified = _qualified_name(op)
    return qualified if qualified is not None else op


def _qualified_name(op: Any) -> Optional[str]:
    """``ns::name`` of a custom operator (its definition, its packet, or one overload), else None."""
    if isinstance(op, OpOverload):
        return op._schema.name
    if isinstance(op, OpOverloadPacket):
        return op._qualified_op_name
    name = getattr(op, "_qualname", None)  # torch.library.custom_op's definition
    return name if isinstance(name, str) and "::" in name else None


def _registered(func: Any) -> Optional[Callable]:
    try:
        found = _REGISTERED.get(func)
    except TypeError:
        found = None
    if found is None:
        qualified = _qualified_name(func)
        found = _REGISTERED.get(qualified if qualified is not None else getattr(func, "__name__", None))
    return found


def _inplace_name(op: Any) -> bool:
    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    return name.endswith("_") and not name.startswith("_")
