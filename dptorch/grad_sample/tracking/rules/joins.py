"""Joining and splitting: cat, stack, split, chunk, unbind."""

from __future__ import annotations

from typing import Callable, Dict

import torch

from dptorch.grad_sample.tracking.args import Tracker, arg, norm_dim, op_name
from dptorch.grad_sample.tracking.tags import DIM, KEEP, ORDERED, WEAK, Lost, ordered_at


def _cat(tr: Tracker, func, args, kwargs):
    tensors = list(arg(args, kwargs, 0, "tensors"))
    dim = arg(args, kwargs, 1, "dim", 0)
    stack = op_name(func) == "stack"
    ref = next((t for t in tensors if t.ndim), tensors[0])
    ndim = ref.ndim + (1 if stack else 0)
    dim = norm_dim(int(dim), ndim)
    items = []
    for t in tensors:
        tag = tr.get(t)
        if type(tag) is int:
            d = tag & DIM
            if stack:
                d = d + 1 if d >= dim else d
            elif d == dim:
                tag = tr.lost("concatenates along the batch dimension", tag)
                items.append((tag, ndim, ndim))
                continue
            items.append(((tag & KEEP) | d, ndim, ndim))
        else:
            items.append((tag, ndim, ndim))
    tag, meeting = tr.combine(items)
    if meeting:
        tensors = list(tensors)
        for i in meeting:
            tensors[i] = tr.meet(tensors[i], tensors[i].ndim, (tag & ~WEAK) - (1 if stack and (tag & DIM) > dim else 0),
                                 broadcasts=False)
        args = (tensors,) + tuple(args[1:]) if args else args
        if not args:
            kwargs = dict(kwargs, tensors=tensors)
    out = tr.run(func, args, kwargs)
    tr.put(out, tag)
    return out


def _split(tr: Tracker, func, args, kwargs):
    name = op_name(func)
    x = args[0]
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if tag is None:
        return out
    ordered = type(tag) is Lost and tag.kind in ORDERED and tag.order is not None
    if type(tag) is int or ordered:
        d = tag.dim if ordered else tag & DIM
        if name == "unbind":
            dim = norm_dim(int(arg(args, kwargs, 1, "dim", 0)), x.ndim)
            if dim == d:
                tag = tr.lost("unbinds the batch", tag) if not ordered else Lost(tag.reason, weak=tag.weak)
            else:
                tag = ordered_at(tag, d - (dim < d)) if ordered else (tag & KEEP) | (d - (1 if dim < d else 0))
        else:
            dim = norm_dim(int(arg(args, kwargs, 2, "dim", 0)), x.ndim)
            if dim == d and not (len(out) == 1 and out[0].shape[d] == x.shape[d]):
                if ordered or not tag & ~(DIM | WEAK):  # pieces of the batch's rows, each saying which
                    return _pieces(tr, out, tag, d)
                tag = tr.lost(f"{name} along the batch dimension", tag)
    if type(tag) is Lost and tag.kind in ORDERED:
        for piece in out:
            tr.put(piece, ordered_at(tag, tag.dim))
        return out
    tr.put_all(out, tag)
    return out


def _pieces(tr: Tracker, out, tag, d: int):
    """Split along the batch dim: piece ``i`` holds the rows ``start_i, ...`` of the batch (or of the rows it
    held), an ordered ``Lost`` of kind "rows" (or of the rows' own kind) saying which."""
    order = tag.order if type(tag) is Lost else torch.arange(sum(piece.shape[d] for piece in out))
    kind, weak = (tag.kind, tag.weak) if type(tag) is Lost else ("rows", bool(tag & WEAK))
    start = 0
    for piece in out:
        rows = order[start:start + piece.shape[d]]
        start += piece.shape[d]
        tr.put(piece, Lost(f"{'a piece' if kind == 'rows' else 'the entries'} of the batch split along it", kind, d,
                           rows, weak=weak) if tr.n > 1 else None)
    return out


RULES: Dict[str, Callable] = {
    "cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _cat,
    "split": _split, "chunk": _split, "tensor_split": _split, "split_with_sizes": _split, "unbind": _split,
}
