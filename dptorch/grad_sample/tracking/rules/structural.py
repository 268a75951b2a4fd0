"""Views, reshapes and movement of dims: where the batch dim goes."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from dptorch.grad_sample.tracking.args import Tracker, arg, dims_arg, norm_dim, op_name, shape_args, tensors_of
from dptorch.grad_sample.tracking.tags import DIM, INNER, KEEP, ORDERED, WEAK, Lost, ordered_at
from dptorch.grad_sample.tracking.writes import derived


def structural(dimfn: Callable, inplace: bool = False, writes: bool = False, shape_only: bool = False,
               aligned: Any = ()):
    """Operations moving ``x``'s dims: ``dimfn(d, shape, args, kwargs, out)`` is the new dim or a reason.

    Other tensor arguments (a norm's weight, a convolution's, an embedding's table) must not derive from
    the batch, except those ``aligned`` names (positions or keywords; "any": all) whose dims are ``x``'s,
    batched exactly as ``x`` is (a grid, unpooling indices, prepended rows); ``shape_only``: they give only
    a shape (``expand_as``). ``inplace``: the operation changes ``x`` itself, its data too if ``writes``
    (``x.cumsum_(1)``).
    """

    def rule(tr: Tracker, func, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        tag = tr.get(x)
        shape = tuple(x.shape)
        mixed = []
        for where, t in ([] if shape_only else tensors_of(args, kwargs)):
            g = tr.get(t)
            if t is not x and derived(g) and not (type(g) is int and g == tag and t.ndim == len(shape) and (
                    aligned == "any" or where[1] in aligned) and t.shape[g & DIM] == shape[g & DIM]):
                mixed.append(g)
        out = tr.run(func, args, kwargs)
        if tag is None and not mixed:
            return out
        new_tag = tag
        if type(tag) is int:
            new = dimfn(tag & DIM, shape, args, kwargs, out if not inplace else x)
            new_tag = (tag & KEEP) | new if type(new) is int else tr.lost(f"{op_name(func)} ({new})", tag)
        elif type(tag) is Lost and tag.kind in ORDERED:  # some rows of the batch: kept where they stay whole
            new = dimfn(tag.dim, shape, args, kwargs, out if not inplace else x) if tag.dim < len(shape) else None
            result = x if inplace else out
            whole = (type(new) is int and not new & ~DIM and isinstance(result, torch.Tensor) and new < result.ndim
                     and result.shape[new] == shape[tag.dim])
            new_tag = ordered_at(tag, new) if whole else Lost(tag.reason, weak=tag.weak)
        if mixed:
            new_tag = tr.lost_from(f"{op_name(func)} with another argument derived from the batch (not batched as "
                                   "its input is)", [tag, *mixed])
        if inplace and writes:
            tr.wrote(x, tag, new_tag)
        elif inplace:
            tr.put(x, new_tag)
        else:
            tr.put_all(out, new_tag)
        return out

    return rule


# ---- dim functions (d: the batch dim of x; shape: x's shape before the operation)


def _d_transpose(d, shape, args, kwargs, out):
    ndim = len(shape)
    if ndim < 2:
        return d
    a = norm_dim(int(arg(args, kwargs, 1, "dim0", kwargs.get("axis0", 0))), ndim)
    b = norm_dim(int(arg(args, kwargs, 2, "dim1", kwargs.get("axis1", 1))), ndim)
    return b if d == a else a if d == b else d


def _d_t(d, shape, args, kwargs, out):
    return 1 - d if len(shape) == 2 else d


def _d_reverse(d, shape, args, kwargs, out):
    return len(shape) - 1 - d


def _d_swap_last(d, shape, args, kwargs, out):
    ndim = len(shape)
    return ndim - 1 if d == ndim - 2 else ndim - 2 if d == ndim - 1 else d


def _d_permute(d, shape, args, kwargs, out):
    dims = shape_args(args, 1) if len(args) > 1 else tuple(kwargs["dims"])
    dims = [norm_dim(int(p), len(shape)) for p in dims]
    return dims.index(d)


def _d_movedim(d, shape, args, kwargs, out):
    ndim = len(shape)
    src = arg(args, kwargs, 1, "source")
    dst = arg(args, kwargs, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src = [norm_dim(s, ndim) for s in src]
    dst = [norm_dim(s, ndim) for s in dst]
    order = [None] * ndim
    for s, t in zip(src, dst):
        order[t] = s
    rest = iter(i for i in range(ndim) if i not in src)
    order = [o if o is not None else next(rest) for o in order]
    return order.index(d)


def _d_unsqueeze(d, shape, args, kwargs, out):
    dim = norm_dim(int(arg(args, kwargs, 1, "dim")), len(shape) + 1)
    return d + 1 if dim <= d else d


def _d_squeeze(d, shape, args, kwargs, out):
    dims = dims_arg(arg(args, kwargs, 1, "dim"), len(shape))
    removed = [i for i in (range(len(shape)) if dims is None else dims) if i < len(shape) and shape[i] == 1]
    if d in removed:
        return "squeezes the batch dimension"
    return d - sum(1 for i in removed if i < d)


def _reshape(tr: Tracker, func, args, kwargs):
    """view, reshape, flatten, unflatten...: the batch dim keeps its place in the row-major order."""
    x = args[0] if args else next(iter(kwargs.values()))
    tag = tr.get(x)
    shape = tuple(x.shape)
    out = tr.run(func, args, kwargs)
    if type(tag) is not int:
        if tag is not None:
            tr.put(out, tag)
        return out
    d, inner = tag & DIM, tag // INNER
    if len(args) > 1 and isinstance(args[1], torch.dtype):  # x.view(dtype)
        new = (d, max(inner, 1)) if d < len(shape) - 1 else None
    else:
        new = _regroup(shape, tuple(out.shape), d, max(inner, 1), tr.n)
    if new is None:
        tr.put(out, tr.lost(f"{op_name(func)} (splits the batch dimension or interleaves it with another)", tag))
    else:
        tr.put(out, (tag & WEAK) | new[0] | (new[1] * INNER if new[1] > 1 else 0))
    return out


def _regroup(in_shape: Sequence[int], out_shape: Sequence[int], d: int, inner: int, n: int) -> Optional[Tuple[int, int]]:
    """Where the batch of a row-major reshape lands: ``(dim, inner)``, or None if it is split or
    interleaved. In ``in_shape`` the batch is dim ``d`` (``n`` groups of ``inner`` rows, 1 if not
    merged); in the result it is a dim of ``n * inner'`` rows with the same elements before it."""
    if 0 in in_shape or n < 1:
        new = _reshape_dim(in_shape, out_shape, d) if inner <= 1 else None
        return None if new is None else (new, 1)
    before = math.prod(in_shape[:d])
    after = inner * math.prod(in_shape[d + 1 :])  # elements of one sample's group
    acc = 1
    for e, s in enumerate(out_shape):
        if acc == before and s >= n and s % n == 0 and (s // n) * math.prod(out_shape[e + 1 :]) == after:
            return e, s // n
        acc *= s
        if acc > before:
            return None
    return None


def _reshape_dim(in_shape: Sequence[int], out_shape: Sequence[int], d: int) -> Optional[int]:
    """Where dim ``d`` of a row-major reshape lands, if it stays a dim of its own."""
    size = in_shape[d]
    if 0 in in_shape:
        return d if d < len(out_shape) and out_shape[d] == size else None
    before = math.prod(in_shape[:d])
    acc = 1
    for e, s in enumerate(out_shape):
        if acc == before and s == size:
            return e
        acc *= s
        if acc > before:
            return None
    return None


def _d_expand(d, shape, args, kwargs, out):
    return d + out.ndim - len(shape)


def _d_repeat(d, shape, args, kwargs, out):
    sizes = shape_args(args, 1) if len(args) > 1 else tuple(kwargs.get("repeats", kwargs.get("dims", ())))
    lead = len(sizes) - len(shape)
    factor = sizes[d + lead] if len(sizes) > d + lead >= 0 else 1
    return d + max(lead, 0) if factor == 1 else "repeats the batch"


def dim_is_batch(pos: int, name: str, default: Any = None, reason: str = "operates along the batch dimension"):
    def dimfn(d, shape, args, kwargs, out):
        dims = dims_arg(arg(args, kwargs, pos, name, default), len(shape))
        return reason if dims is None or d in dims else d

    return dimfn


def _d_repeat_interleave(d, shape, args, kwargs, out):
    dim = arg(args, kwargs, 2, "dim")
    if dim is None or norm_dim(int(dim), len(shape)) == d:
        return "repeats rows of the batch"
    return d


def _d_narrow(d, shape, args, kwargs, out):
    dim = norm_dim(int(arg(args, kwargs, 1, "dim")), len(shape))
    return d if dim != d or out.shape[d] == shape[d] else "keeps part of the batch"


def _d_select(d, shape, args, kwargs, out):
    dim = norm_dim(int(arg(args, kwargs, 1, "dim")), len(shape))
    return "selects one sample" if dim == d else d - (1 if dim < d else 0)


def _d_unfold(d, shape, args, kwargs, out):
    dim = norm_dim(int(arg(args, kwargs, 1, "dimension")), len(shape))
    return "unfolds the batch dimension" if dim == d else d


def _d_keep_leading(nkeep_from_end: int):
    """Dims before the last ``nkeep_from_end`` stay (linear's features, layer_norm's shape...)."""

    def dimfn(d, shape, args, kwargs, out):
        return d if d < len(shape) - nkeep_from_end else "mixes the batch dimension"

    return dimfn


def d_first(d, shape, args, kwargs, out):
    return d if d == 0 else "expects the batch along dim 0"


def d_first_two(d, shape, args, kwargs, out):
    return d if d in (0, 1) else "works across the batch dimension"


def _d_pad(d, shape, args, kwargs, out):
    pad = arg(args, kwargs, 1, "pad")
    ndim = len(shape)
    for i in range(len(pad) // 2):
        if ndim - 1 - i == d and (pad[2 * i] or pad[2 * i + 1]):
            return "pads the batch dimension"
    return d


def _d_roll(d, shape, args, kwargs, out):
    dims = arg(args, kwargs, 2, "dims")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return "rolls the flattened batch"
    return "reorders the batch" if d in dims_arg(dims, len(shape)) else d


def _d_flip(d, shape, args, kwargs, out):
    dims = shape_args(args, 1) if len(args) > 1 else tuple(kwargs.get("dims", ()))
    return "reorders the batch" if d in [norm_dim(int(x), len(shape)) for x in dims] else d


def _d_rot90(d, shape, args, kwargs, out):
    dims = arg(args, kwargs, 2, "dims", (0, 1))
    return "reorders the batch" if d in [norm_dim(int(x), len(shape)) for x in dims] else d


def _d_view_as_real(d, shape, args, kwargs, out):
    return d


RULES: Dict[str, Callable] = {
    "transpose": structural(_d_transpose), "swapaxes": structural(_d_transpose), "swapdims": structural(_d_transpose),
    "t": structural(_d_t), "get:T": structural(_d_reverse), "get:mT": structural(_d_swap_last),
    "get:mH": structural(_d_swap_last), "get:H": structural(_d_t), "adjoint": structural(_d_swap_last),
    "permute": structural(_d_permute), "movedim": structural(_d_movedim), "moveaxis": structural(_d_movedim),
    "unsqueeze": structural(_d_unsqueeze), "squeeze": structural(_d_squeeze),
    "view": _reshape, "reshape": _reshape, "view_as": _reshape, "reshape_as": _reshape, "flatten": _reshape,
    "unflatten": _reshape, "ravel": _reshape,
    "expand": structural(_d_expand), "expand_as": structural(_d_expand, shape_only=True), "broadcast_to": structural(_d_expand),
    "repeat": structural(_d_repeat), "tile": structural(_d_repeat),
    "repeat_interleave": structural(_d_repeat_interleave), "narrow": structural(_d_narrow),
    "select": structural(_d_select), "unfold": structural(_d_unfold),
    "flip": structural(_d_flip), "fliplr": structural(dim_is_batch(9, "_", 1)),
    "flipud": structural(dim_is_batch(9, "_", 0)), "roll": structural(_d_roll), "rot90": structural(_d_rot90),
    "view_as_real": structural(_d_view_as_real), "view_as_complex": structural(_d_keep_leading(1)),
    "pad": structural(_d_pad),
    # in place
    "unsqueeze_": structural(_d_unsqueeze, inplace=True), "squeeze_": structural(_d_squeeze, inplace=True),
    "t_": structural(_d_t, inplace=True), "transpose_": structural(_d_transpose, inplace=True),
    "swapaxes_": structural(_d_transpose, inplace=True), "swapdims_": structural(_d_transpose, inplace=True),
}
