"""Contractions: linear, matmul and its variants, einsum, attention, pairwise similarities."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from torch import Tensor

from dptorch.grad_sample.tracking.args import Tracker, arg, norm_dim, op_name
from dptorch.grad_sample.tracking.rules.opaque import lost_if_tagged
from dptorch.grad_sample.tracking.tags import DIM, KEEP, ORDERED, WEAK, Lost, ordered_at


def _matmul_dims(d: int, ndim: int, other_ndim: int, out_ndim: int, left: bool) -> Any:
    """The result dim of an operand's dim ``d`` in ``left @ right``, or a reason."""
    if ndim == 1:
        return "contracts the batch dimension"
    if left:
        if d == ndim - 1:
            return "contracts the batch dimension"
        if d == ndim - 2:
            return out_ndim - 2 if other_ndim > 1 else out_ndim - 1
    else:
        if d == ndim - 2:
            return "contracts the batch dimension"
        if d == ndim - 1:
            return out_ndim - 1
    return d + (out_ndim - (2 if other_ndim > 1 else 1)) - (ndim - 2)


def _matmul(tr: Tracker, func, args, kwargs):
    name = op_name(func)
    if name == "__rmatmul__":
        return _matmul_pair(tr, func, args, kwargs, 1, 0)
    return _matmul_pair(tr, func, args, kwargs, 0, 1)


def _ordered_matmul(tr, func, args, kwargs, a, b, ta, tb, out_ndim):
    """A matrix product of some rows of the batch (an ordered ``Lost``) with a shared operand: the same rows
    where they stay a dim of their own (not one the product sums over)."""
    tag, t, other, left = (ta, a, b, True) if ta is not None else (tb, b, a, False)
    new = _matmul_dims(tag.dim, t.ndim, other.ndim, out_ndim, left) if tag.dim < t.ndim else None
    out = tr.run(func, args, kwargs)
    tr.put_all(out, ordered_at(tag, new) if type(new) is int else Lost(tag.reason, weak=tag.weak))
    return out


def _matmul_pair(tr, func, args, kwargs, ia, ib, extra: Optional[int] = None):
    a, b = args[ia], args[ib]
    ta, tb = tr.get(a), tr.get(b)
    te = tr.get(args[extra]) if extra is not None else None
    out_ndim = max(a.ndim, b.ndim) if a.ndim > 1 and b.ndim > 1 else max(a.ndim, b.ndim) - 1
    if extra is None and (ta is None or tb is None) and type(ta or tb) is Lost and (ta or tb).kind in ORDERED:
        return _ordered_matmul(tr, func, args, kwargs, a, b, ta, tb, out_ndim)
    items = []
    for t, tag, left, other in ((a, ta, True, b), (b, tb, False, a)):
        if type(tag) is int:
            new = _matmul_dims(tag & DIM, t.ndim, other.ndim, out_ndim, left)
            items.append(((tag & KEEP) | new if type(new) is int else tr.lost(f"{op_name(func)} {new}", tag), out_ndim, out_ndim))
        else:
            items.append((tag, out_ndim, out_ndim))
    if extra is not None:
        items.append((te, args[extra].ndim, out_ndim))
    tag, meeting = tr.combine(items)
    for i in meeting:
        t, pos = ((a, ia), (b, ib), (args[extra] if extra is not None else None, extra))[i]
        if i < 2 and (t.ndim < 2 or (tag & DIM) >= out_ndim - 2):
            raise tr.unsupported_meeting(items[i][0], f"{op_name(func)} along the matrix dimensions")
        # broadcast (batch) dims of a matrix operand align with the result's like elementwise ones
        args = args[:pos] + (tr.meet(t, out_ndim, tag & ~WEAK),) + args[pos + 1 :]
    out = tr.run(func, args, kwargs)
    tr.put_all(out, tag)
    return out


_ADDMM_NAMES = {"addmm": ("input", "mat1", "mat2"), "baddbmm": ("input", "batch1", "batch2"),
                "addmv": ("input", "mat", "vec")}


def _addmm(tr, func, args, kwargs):  # addmm(input, m1, m2), baddbmm(input, b1, b2), addmv, addbmm
    name = op_name(func)
    if name == "addbmm":
        return lost_if_tagged(tr, func, args, kwargs, "addbmm sums over the batch of matrices")
    names = _ADDMM_NAMES[name]
    if len(args) < 3:  # keyword operands (BLOOM's alibi.baddbmm(batch1=..., batch2=...)): call positionally
        kwargs = dict(kwargs)
        args = tuple(args) + tuple(kwargs.pop(k) for k in names[len(args):])
    return _matmul_pair(tr, func, args, kwargs, 1, 2, extra=0)


def _linear(tr: Tracker, func, args, kwargs):
    x = arg(args, kwargs, 0, "input")
    weight = arg(args, kwargs, 1, "weight")
    bias = arg(args, kwargs, 2, "bias")
    tag = tr.get(x)
    others = [tr.get(w) for w in (weight, bias) if isinstance(w, Tensor)]
    if any(type(o) is tuple for o in others) and type(tag) is int and tr.n > 1:
        raise tr.unsupported_meeting(next(o for o in others if type(o) is tuple), "linear as its weight")
    out = tr.run(func, args, kwargs)
    if any(type(o) is int or type(o) is Lost for o in others):
        tr.put(out, tr.lost_from("linear with weights derived from the batch", others))
    elif type(tag) is int:
        d = tag & DIM
        tr.put(out, tag if d < x.ndim - 1 else tr.lost("linear over the batch dimension", tag))
    elif tag is not None or any(type(o) is tuple for o in others):
        tr.put(out, tag if tag is not None else next(o for o in others if type(o) is tuple))
    return out


def _einsum(tr: Tracker, func, args, kwargs):
    equation = args[0]
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    tags = [tr.get(t) for t in operands]
    out = tr.run(func, args, kwargs)
    try:
        result = _einsum_tag(tr, equation, operands, tags)
    except (ValueError, IndexError):
        result = tr.lost("einsum (equation not understood)")
    if any(type(t) is tuple for t in tags) and type(result) is int:
        raise tr.unsupported_meeting(next(t for t in tags if type(t) is tuple), "einsum")
    tr.put(out, result)
    return out


def _einsum_tag(tr: Tracker, equation: str, operands: List[Tensor], tags: List[Any]) -> Any:
    equation = equation.replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    inputs = lhs.split(",")
    ell = max((t.ndim - len(s.replace("...", "")) for s, t in zip(inputs, operands) if "..." in s), default=0)
    marks = [chr(0x100 + i) for i in range(ell)]

    def expand(sub: str, ndim: int) -> str:
        if "..." not in sub:
            return sub
        k = ndim - len(sub.replace("...", ""))
        return sub.replace("...", "".join(marks[ell - k :]))

    subs = [expand(s, t.ndim) for s, t in zip(inputs, operands)]
    if "->" in equation:
        output = rhs.replace("...", "".join(marks))
    else:
        letters = "".join(subs)
        output = "".join(marks) + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in marks))
    items = []
    for sub, tag in zip(subs, tags):
        if type(tag) is int:
            letter = sub[tag & DIM]
            if sub.count(letter) > 1:  # "ii->i": each sample's element at its own place in the batch
                items.append((tr.lost("einsum takes a diagonal with the batch dimension", tag), 0, 0))
            elif letter in output:
                items.append(((tag & KEEP) | output.index(letter), len(output), len(output)))
            else:
                items.append((tr.lost("einsum contracts the batch dimension", tag), 0, 0))
        else:
            items.append((tag, 0, 0))
    return tr.combine(items)[0]


def _sdpa(tr: Tracker, func, args, kwargs):
    names = ("query", "key", "value", "attn_mask")
    values = [arg(args, kwargs, i, n) for i, n in enumerate(names)]
    q = values[0]
    out_ndim = q.ndim
    items = []
    for i, t in enumerate(values):
        tag = tr.get(t) if isinstance(t, Tensor) else None
        if type(tag) is int:
            d = tag & DIM
            if i == 3:
                pos = d + out_ndim - t.ndim
                bad = pos == out_ndim - 1
            else:
                pos = d + out_ndim - t.ndim
                bad = d == t.ndim - 1 or (i > 0 and d == t.ndim - 2)
            tag = tr.lost("attention across the batch dimension", tag) if bad else (tag & KEEP) | pos
            items.append((tag, out_ndim, out_ndim))
        else:
            items.append((tag, out_ndim, out_ndim))
    tag, meeting = tr.combine(items)
    for i in meeting:
        t = values[i]
        if i != 3 or (tag & DIM) >= out_ndim - 2:
            raise tr.unsupported_meeting(items[i][0], "scaled_dot_product_attention as query, key or value")
        substitute = tr.meet(t, out_ndim, tag & ~WEAK)
        if len(args) > 3:
            args = args[:3] + (substitute,) + args[4:]
        else:
            kwargs = dict(kwargs, attn_mask=substitute)
    out = tr.run(func, args, kwargs)
    tr.put(out, tag)
    return out


def _cosine(tr: Tracker, func, args, kwargs):  # cosine_similarity(x1, x2, dim=1), pairwise_distance
    name = op_name(func)
    x1, x2 = args[0], args[1]
    out_ndim = max(x1.ndim, x2.ndim)
    tag = tr.combine([(tr.get(x1), x1.ndim, out_ndim), (tr.get(x2), x2.ndim, out_ndim)])[0]
    out = tr.run(func, args, kwargs)
    if type(tag) is int:
        dim = out_ndim - 1 if name == "pairwise_distance" else norm_dim(int(arg(args, kwargs, 2, "dim", 1)), out_ndim)
        keep = name == "pairwise_distance" and bool(arg(args, kwargs, 4, "keepdim", False))
        d = tag & DIM
        tag = tr.lost(f"{name} across the batch dimension", tag) if d == dim else (tag & KEEP) | (d if keep or d < dim else d - 1)
    tr.put(out, tag)
    return out


RULES: Dict[str, Callable] = {
    "linear": _linear, "bilinear": lost_if_tagged, "matmul": _matmul, "__matmul__": _matmul, "__rmatmul__": _matmul,
    "mm": _matmul, "bmm": _matmul, "mv": _matmul, "dot": _matmul, "vdot": _matmul, "inner": lost_if_tagged,
    "addmm": _addmm, "baddbmm": _addmm, "addmv": _addmm, "addbmm": _addmm, "einsum": _einsum,
    "scaled_dot_product_attention": _sdpa, "cosine_similarity": _cosine, "pairwise_distance": _cosine,
}
