"""Elementwise operations (broadcasting their tensor arguments), in place or not."""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict

from torch import Tensor

from dptorch.grad_sample.tracking.args import Tracker, arg, op_name, replace_arg, tensors_of
from dptorch.grad_sample.tracking.rules.opaque import lost_if_tagged
from dptorch.grad_sample.tracking.tags import DIM, ORDERED, WEAK, Lost, ordered_at


def broadcast(tr: Tracker, func, args, kwargs, inplace: bool = False, name: str = ""):
    """Elementwise operations, broadcasting their tensor arguments."""
    if not inplace and not tr.writes.dirty:  # fast path: one tagged argument (the others shared), nothing meets
        table, memory = tr._table, tr.memory
        single = None
        for a in args if not kwargs else (*args, *kwargs.values()):
            if isinstance(a, Tensor):
                entry = table.get(id(a))
                if entry is not None and entry[0]() is a:
                    if single is not None:
                        single = None
                        break
                    single = (a, entry[1])
                elif memory.holds(a):  # untagged, in memory that holds batch data: an alias to look up
                    single = None
                    break
        else:
            if single is not None:
                out = tr.run(func, args, kwargs)
                t, tag = single
                if isinstance(out, Tensor):
                    if type(tag) is int:
                        tag = tag + (out.ndim - t.ndim) if _full(t, tag, out) else _broadcast_rows(tr, tag)
                    elif type(tag) is Lost and tag.kind in ORDERED:
                        tag = _ordered_rows(t, tag, out)
                    tr.put(out, tag)
                return out
    tensors = list(tensors_of(args, kwargs))
    if inplace and tensors and tensors[0][0] == ("a", 0):
        out_ndim = tensors[0][1].ndim
    else:
        out_ndim = max(t.ndim for _, t in tensors)
    tags = [tr.get(t) for _, t in tensors]
    if name == "copy_":  # the values are src's; self's old tag goes
        tags[0] = None
    tag, meeting = tr.combine([(g, t.ndim, out_ndim) for g, (_, t) in zip(tags, tensors)], elementwise=True)
    for i in meeting:
        where, t = tensors[i]
        if inplace and where == ("a", 0):
            raise tr.unsupported_meeting(tags[i], f"an in-place {name or 'operation'} that writes the batch into it")
        args, kwargs = replace_arg(args, kwargs, where, tr.meet(t, out_ndim, tag & ~WEAK))
    out = tr.run(func, args, kwargs)
    result = args[0] if inplace else out
    if type(tag) is int and isinstance(result, Tensor):
        short = next((g for g, (_, t) in zip(tags, tensors) if type(g) is int and not _full(t, g, result)), None)
        if short is not None:
            tag = _broadcast_rows(tr, short)
    if inplace:
        target = args[0]
        tr.wrote(target, tags[0] if name != "copy_" else tr.get(target), tag)
    else:
        tr.put_all(out, tag)
    return out


def _full(t: Tensor, tag: int, result: Tensor) -> bool:
    """Whether ``t``, batched along ``tag``'s dim, has there the rows of ``result`` (aligned from the right)."""
    d = tag & DIM
    at = d + result.ndim - t.ndim
    return d < t.ndim and 0 <= at < result.ndim and t.shape[d] == result.shape[at]


def _ordered_rows(t: Tensor, tag: Lost, result: Tensor) -> Lost:
    """Some of the batch's rows (``tag``, ordered) in an elementwise result: the same rows where ``t``'s fill
    the result's dim, lost where they are broadcast."""
    at = tag.dim + result.ndim - t.ndim
    if tag.dim < t.ndim and 0 <= at < result.ndim and t.shape[tag.dim] == result.shape[at]:
        return ordered_at(tag, at)
    return Lost(tag.reason, weak=tag.weak)


def _broadcast_rows(tr: Tracker, tag: int):
    """The tag of a result into whose rows a batched argument of fewer rows was broadcast: its rows are not
    the samples' (a batch dim cut to one row, sample 0's, would reach every sample)."""
    return tr.lost("an elementwise operation broadcasting a batch dimension of other size than the result's", tag)


def _self_only(tr, func, args, kwargs):
    """``x.to(other)``, ``x.type_as(other)``: the result is ``x``'s data."""
    x = arg(args, kwargs, 0, "input")
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if type(tag) is Lost and tag.kind in ORDERED and isinstance(out, Tensor):
        tag = _ordered_rows(x, tag, out)
    if tag is not None:
        tr.put_all(out, tag)
    return out


def inplace_rule(base: str, tr, func, args, kwargs):
    """The in-place variant of the elementwise operation ``base`` (``x.add_(y)``, ``x += y``)."""
    return broadcast(tr, func, args, kwargs, inplace=True, name=base + "_")


def _triangle(tr, func, args, kwargs):
    """``tril``/``triu`` keep or zero an element by its place in the last two dims: elementwise only where
    the batch is not one of them (else each sample would be cut by its place in the batch)."""
    x = arg(args, kwargs, 0, "input")
    tag = tr.get(x)
    name = op_name(func)
    if type(tag) is int and (tag & DIM) >= x.ndim - 2:
        out = tr.run(func, args, kwargs)
        lost = tr.lost(f"{name} across the batch dimension (a sample's elements kept by its place)", tag)
        if name.endswith("_"):
            tr.wrote(x, tag, lost)
        else:
            tr.put(out, lost)
        return out
    return broadcast(tr, func, args, kwargs, inplace=name.endswith("_"), name=name)


def _where(tr, func, args, kwargs):
    """``where(cond, x, y)`` is elementwise; ``where(cond)`` is ``nonzero``: positions, not rows."""
    if len(list(tensors_of(args, kwargs))) == 1 and len(args) + len(kwargs) == 1:
        return lost_if_tagged(tr, func, args, kwargs, "where(condition), the positions of a batch-derived mask")
    return broadcast(tr, func, args, kwargs)


_BROADCAST = """
abs absolute neg negative exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sin cos tan tanh sigmoid relu relu6 gelu silu
mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid softplus softsign tanhshrink logsigmoid log_sigmoid sign sgn floor ceil
round trunc frac fix reciprocal square erf erfc erfinv sinh cosh asin acos atan arcsin arccos arctan asinh acosh atanh
arcsinh arccosh arctanh isnan isinf isfinite isneginf isposinf isreal logical_not bitwise_not nan_to_num clamp clip
clamp_min clamp_max dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout clone contiguous detach
float double half bfloat16 int long short bool char byte cpu cuda pin_memory requires_grad_ conj resolve_conj
resolve_neg threshold hardshrink softshrink rrelu logit sinc deg2rad rad2deg digamma lgamma polygamma i0
bernoulli fill zero normal uniform exponential random geometric cauchy log_normal add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow float_power maximum
minimum fmax fmin where masked_fill lerp addcmul addcdiv eq ne lt le gt ge equal greater less greater_equal less_equal
not_equal logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift
atan2 arctan2 hypot copysign xlogy heaviside nextafter ldexp isclose rsub prelu
__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __div__ __rdiv__ __floordiv__
__rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__ __lshift__
__rlshift__ __rshift__ __rrshift__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __neg__ __pos__ __abs__ __invert__
positive get:data get:real get:imag alias
"""

INPLACE_ALIASES = {"__iadd__": "add", "__isub__": "sub", "__imul__": "mul", "__itruediv__": "div", "__idiv__": "div",
                    "__ifloordiv__": "floor_divide", "__imod__": "remainder", "__ipow__": "pow", "__iand__": "bitwise_and",
                    "__ior__": "bitwise_or", "__ixor__": "bitwise_xor", "__ilshift__": "bitwise_left_shift",
                    "__irshift__": "bitwise_right_shift"}


RULES: Dict[str, Callable] = {n: broadcast for n in _BROADCAST.split()}
RULES.update({"to": _self_only, "type": _self_only, "type_as": _self_only, "copy_": partial(inplace_rule, "copy"),
              "where": _where, "tril": _triangle, "triu": _triangle, "tril_": _triangle, "triu_": _triangle})
