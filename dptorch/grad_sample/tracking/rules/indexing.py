"""Indexing: getitem and setitem, gather and scatter, index_*, take."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from dptorch.grad_sample.tracking.args import Tracker, arg, norm_dim, op_name, tensors_of
from dptorch.grad_sample.tracking.tags import DIM, KEEP, ROWS_ORDERED, WEAK, Lost
from dptorch.grad_sample.tracking.traced_values import is_arange
from dptorch.grad_sample.tracking.writes import derived


def _gather(tr: Tracker, func, args, kwargs):
    """gather(x, dim, index), take_along_dim(x, index, dim), scatter*(x, dim, index, src), index_*(x, dim, index, src).

    Along a dim other than ``dim``, position ``p`` of the result reads position ``p`` of each argument, so a
    batch there stays only where every batched argument has the result's rows there: a shorter index keeps
    sample 0's rows alone (broadcast later into every sample's), a shared ``self`` of other rows adds rows of
    no sample. Along ``dim`` row ``i`` may read any row: the batch is lost, except in a lookup (gather from
    a shared tensor by an index batched along ``dim``: row ``i`` reads by sample ``i``'s indices only).
    """
    name = op_name(func).rstrip("_")
    inplace = op_name(func).endswith("_")
    x = args[0]
    if name == "take_along_dim":
        dim, index = arg(args, kwargs, 2, "dim"), arg(args, kwargs, 1, "indices")
    else:
        dim, index = arg(args, kwargs, 1, "dim"), arg(args, kwargs, 2, "index")
    dim = None if dim is None else norm_dim(int(dim), max(x.ndim, 1))
    parts = [t for _, t in tensors_of(args, kwargs)]
    items = []
    if name.startswith("index_"):
        # the 1-D index and a 0-d fill value do not align with x: derived from the batch, they mix it
        loose = [tr.get(t) for t in parts if t.ndim != x.ndim and t is not x]
        if any(derived(g) for g in loose):
            items.append((tr.lost_from(f"{name} by an index or value derived from the batch", loose), 0, 0))
        parts = [t for t in parts if t.ndim == x.ndim or t is x]
    old = tr.get(x)
    out = tr.run(func, args, kwargs)
    result = x if inplace else out
    lookup = name in ("gather", "take_along_dim") and old is None and dim is not None
    for t in parts:
        tag = tr.get(t)
        if type(tag) is int:
            at = (tag & DIM) + result.ndim - t.ndim
            if dim is None or at == dim:
                if not (lookup and t is index):
                    tag = tr.lost(f"{name} along the batch dimension", tag)
            elif t.shape[tag & DIM] != result.shape[at]:  # a shorter index, or a longer shared self
                tag = tr.lost(f"{name} with a result of {result.shape[at]} along a batch dimension of "
                              f"{t.shape[tag & DIM]}", tag)
        items.append((tag, t.ndim, result.ndim))
    tag, meeting = tr.combine(items)
    if meeting:
        raise tr.unsupported_meeting(items[meeting[0]][0], name)
    if type(tag) is int and isinstance(index, Tensor) and index.ndim == result.ndim:
        at, rows = tag & DIM, index.shape[tag & DIM]
        if rows != result.shape[at] and not (name == "take_along_dim" and rows == 1):
            # a shared index of fewer rows: the first samples are gathered or written otherwise than the rest
            tag = tr.lost(f"{name} by an index of {rows} along a batch dimension of {result.shape[at]}", tag)
    if inplace:
        tr.wrote(x, old, tag)
    else:
        tr.put(out, tag)
    return out


def _take(tr, func, args, kwargs):
    x, index = args[0], arg(args, kwargs, 1, "index")
    tx, ti = tr.get(x), tr.get(index)
    out = tr.run(func, args, kwargs)
    if tx is not None and type(tx) is not tuple:
        tr.put(out, tr.lost("take over the flattened batch", tx))
    elif type(tx) is tuple and type(ti) is int:
        raise tr.unsupported_meeting(tx, "take with batched indices")
    else:
        tr.put(out, ti if ti is not None else tx)
    return out


def _index_layout(x: Tensor, index: Any):
    """For ``x[index]``: the result's dims as sources (an int: a dim of x; None: a new dim; "A": the
    advanced-index block), the advanced index tensors, x's dims consumed by advanced or integer
    indices, and x's dims sliced partially."""
    items = index if isinstance(index, tuple) else (index,)
    consumed = 0
    for it in items:
        if it is None or it is Ellipsis:
            continue
        if isinstance(it, Tensor) and it.dtype in (torch.bool, torch.uint8):
            consumed += max(it.ndim, 1)
        elif isinstance(it, bool):
            continue
        else:
            consumed += 1
    fill = x.ndim - consumed
    layout: List[Any] = []
    advanced: List[Tuple[Any, List[int]]] = []
    removed: List[int] = []
    partial_: List[int] = []
    src = 0
    for it in items:
        if it is None or isinstance(it, bool):
            layout.append(None)
        elif it is Ellipsis:
            for _ in range(fill):
                layout.append(src)
                src += 1
        elif isinstance(it, slice):
            size = x.shape[src]
            full = (it.start in (None, 0) or it.start <= -size) and (it.stop is None or it.stop >= size) and it.step in (None, 1)
            if not full:
                partial_.append(src)
            layout.append(src)
            src += 1
        elif isinstance(it, (Tensor, list)):
            k = max(it.ndim, 1) if isinstance(it, Tensor) and it.dtype in (torch.bool, torch.uint8) else 1
            if isinstance(it, Tensor) and it.ndim == 0 and it.dtype not in (torch.bool, torch.uint8):
                removed.append(src)
                advanced.append((it, [src]))
            else:
                advanced.append((it, list(range(src, src + k))))
                layout.append("A")
            src += k
        else:  # an integer
            removed.append(src)
            src += 1
    while src < x.ndim:
        layout.append(src)
        src += 1
    return layout, advanced, removed, partial_


def _identity_index_dim(index: Any, n: int) -> Optional[int]:
    """The dim along which an integer index tensor is ``arange(n)`` (sizes 1 elsewhere), else None."""
    if not isinstance(index, Tensor) or index.dtype in (torch.bool, torch.uint8) or index.numel() != n:
        return None
    dims = [i for i, s in enumerate(index.shape) if s != 1]
    if len(dims) > 1 or (not dims and n != 1):
        return None
    if not is_arange(index, n):
        return None
    return dims[0] if dims else 0


def _advanced_block(layout: List[Any], advanced) -> Tuple[List[Any], int, int]:
    """Replace the "A" markers by the advanced block: (layout, block start, block rank)."""
    rank = 0
    for it, dims in advanced:
        if isinstance(it, Tensor):
            rank = max(rank, 1 if it.dtype in (torch.bool, torch.uint8) else it.ndim)
        else:
            rank = max(rank, 1)
    marks = [i for i, s in enumerate(layout) if s == "A"]
    if not marks:
        return layout, 0, 0
    rest = [s for s in layout if s != "A"]
    contiguous = marks == list(range(marks[0], marks[0] + len(marks)))
    start = marks[0] if contiguous else 0
    return rest[:start] + ["A"] * rank + rest[start:], start, rank


def _getitem(tr: Tracker, func, args, kwargs):
    x, index = args[0], args[1]
    xtag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if not isinstance(out, Tensor):
        return out
    try:
        tag = _index_tag(tr, x, index, xtag, out.ndim)
    except (TypeError, ValueError, IndexError):
        tag = tr.lost("indexing the tracker does not follow", xtag) if xtag is not None else None
    tr.put(out, tag)
    return out


def _index_tag(tr: Tracker, x: Tensor, index: Any, xtag: Any, out_ndim: int) -> Any:
    layout, advanced, removed, partial_ = _index_layout(x, index)
    layout, start, rank = _advanced_block(layout, advanced)
    items = []
    if type(xtag) is Lost and xtag.kind in ROWS_ORDERED and xtag.order is not None and xtag.dim < x.ndim:
        d = xtag.dim  # some of the batch's rows: a slice of them is some of its rows too; anything else is lost
        if d in removed or any(d in dims for _, dims in advanced) or d not in layout or advanced:
            return Lost(xtag.reason)
        return _rows_of_batch(tr, x, index, d, layout.index(d), 0, xtag.order)
    if type(xtag) is int:
        d = xtag & DIM
        if d in removed:
            return tr.lost("indexes one sample", xtag)
        by = next((it for it, dims in advanced if d in dims), None)
        if by is not None:
            at = _identity_index_dim(by, x.shape[d])
            if at is None:
                return tr.lost("indexes the batch dimension with a tensor", xtag)
            # x[arange(n)[:, None], ...]: row i of the result is sample i's (HF's padding masks, pooling)
            items.append(((xtag & KEEP) | (start + at + rank - by.ndim), out_ndim, out_ndim))
        elif d in partial_:
            return _rows_of_batch(tr, x, index, d, layout.index(d), xtag)
        else:
            items.append(((xtag & KEEP) | layout.index(d), out_ndim, out_ndim))
    else:
        items.append((xtag, out_ndim, out_ndim))
    for it, _ in advanced:
        if isinstance(it, Tensor):
            tag = tr.get(it)
            if type(tag) is int:
                if it.dtype in (torch.bool, torch.uint8):
                    tag = tr.lost("a boolean mask over the batch", tag)
                else:
                    tag = (tag & KEEP) | (start + (tag & DIM) + rank - it.ndim)
            elif type(tag) is tuple:
                tag = None  # indices carry no gradient
            items.append((tag, out_ndim, out_ndim))
    tag, meeting = tr.combine(items)
    if meeting:
        raise tr.unsupported_meeting(items[meeting[0]][0], "indexing with batched indices")
    return tag


def _setitem(tr: Tracker, func, args, kwargs):
    x, index, value = args[0], args[1], args[2]
    xtag = tr.get(x)
    vtag = tr.get(value) if isinstance(value, Tensor) else None
    itags = [tr.get(t) for t in _index_tensors(index)]
    if any(derived(g) for g in itags):  # which elements are written depends on the batch
        out = tr.run(func, args, kwargs)
        tr.wrote(x, xtag, tr.lost_from("an indexed assignment whose index derives from the batch", [xtag, vtag, *itags]))
        return out
    try:
        layout, advanced, removed, partial_ = _index_layout(x, index)
        layout, start, rank = _advanced_block(layout, advanced)
    except (TypeError, ValueError, IndexError):
        layout = None
    if vtag is None or type(vtag) is tuple:
        part = _part_of_batch(xtag, x, layout, advanced, removed, partial_)
        if part is not None:  # some samples written, the others not: each is treated by its place in the batch
            out = tr.run(func, args, kwargs)
            tr.wrote(x, xtag, tr.lost(f"an indexed assignment into {part}", xtag))
            return out
    if vtag is None:
        out = tr.run(func, args, kwargs)
        return out
    region_ndim = len(layout) if layout is not None else 0
    new = xtag
    if type(vtag) is int and layout is not None:
        r = (vtag & DIM) + region_ndim - value.ndim
        src = layout[r] if 0 <= r < region_ndim else None
        if type(src) is int and src in partial_:  # the rest of that dim keeps other data: rows of no sample
            new = tr.lost("batched values written into a slice of another tensor's dim", vtag)
        elif type(src) is int:
            new = tr.combine([((vtag & KEEP) | src, x.ndim, x.ndim), (xtag if type(xtag) is not tuple else None, x.ndim, x.ndim)])[0]
            if type(xtag) is tuple:
                new = tr.lost("batched values written into a shared tensor", vtag)
        else:
            new = tr.lost("batched values written across the batch dimension", vtag)
    elif type(vtag) is int:
        new = tr.lost("batched values written by an index the tracker does not follow", vtag)
    elif type(vtag) is Lost:
        new = vtag if xtag is None or type(xtag) is not int else tr.lost(vtag.reason, vtag)
    elif type(vtag) is tuple:
        if type(xtag) is int and layout is not None and (xtag & DIM) in layout:
            value = tr.meet(value, region_ndim, layout.index(xtag & DIM) + (xtag & ~(DIM | WEAK)))
            args = (x, index, value)
        elif type(xtag) is int:
            raise tr.unsupported_meeting(vtag, "an indexed assignment")
        elif xtag is None or type(xtag) is tuple:
            new = vtag if xtag is None else tuple(dict.fromkeys(xtag + vtag))
    out = tr.run(func, args, kwargs)
    tr.wrote(x, xtag, new)
    return out


def _part_of_batch(xtag: Any, x: Tensor, layout: Optional[List[Any]], advanced, removed: List[int],
                   partial_: List[int]) -> Optional[str]:
    """What part of ``x``'s batch dim an indexed assignment writes, where it is not the whole (None)."""
    if type(xtag) is not int:
        return None
    d = xtag & DIM
    if layout is None:
        return "the batch dimension, by an index the tracker does not follow"
    if d in removed:
        return "one sample"
    if d in partial_:
        return "a slice of the batch"
    by = next((it for it, dims in advanced if d in dims), None)
    if by is not None and not (isinstance(by, Tensor) and by.dtype in (torch.bool, torch.uint8)) and \
            _identity_index_dim(by, x.shape[d]) is None:
        return "rows of the batch chosen by an index"
    return None


def _index_tensors(index: Any) -> List[Tensor]:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return [it for it in items if isinstance(it, Tensor)]


def _index_select(tr: Tracker, func, args, kwargs):
    """index_select along the batch dim: a permutation of the rows keeps track of their samples."""
    x = args[0]
    tag = tr.get(x)
    dim = norm_dim(int(arg(args, kwargs, 1, "dim")), max(x.ndim, 1))
    index = arg(args, kwargs, 2, "index")
    itag = tr.get(index) if isinstance(index, Tensor) else None
    if itag is not None:  # rows chosen by the batch: row i of the result is x's row index[i]
        if type(tag) is tuple and type(itag) is int and x.requires_grad and tr.n > 1:
            raise tr.unsupported_meeting(tag, "index_select with indices derived from the batch")
        out = tr.run(func, args, kwargs)
        if type(itag) is int and itag & DIM == 0 and index.ndim == 1 and (tag is None or type(tag) is tuple):
            tr.put(out, (itag & KEEP) | dim)
        else:
            tr.put(out, tr.lost_from("index_select of rows chosen by the batch", [tag, itag]))
        return out
    out = tr.run(func, args, kwargs)
    if tag is None:
        return out
    if type(tag) is int and (tag & ~WEAK) == dim:
        tag = _reorder(tr, tag, None, dim, index, x.shape[dim])
    elif type(tag) is int and (tag & DIM) == dim:
        tag = tr.lost("index_select along a merged batch dimension", tag)
    elif type(tag) is Lost and tag.kind == "permuted" and tag.dim == dim:
        tag = _reorder(tr, dim, tag.order, dim, index, x.shape[dim])
    tr.put(out, tag)
    return out


def _reorder(tr: Tracker, tag: int, order: Optional[Tensor], dim: int, index: Tensor, n: int) -> Any:
    index = index.reshape(-1).to("cpu")
    identity = torch.arange(n)
    new = index if order is None else order.to("cpu")[index]
    if torch.equal(new, identity):
        return tag
    if new.numel() == n and torch.equal(new.sort().values, identity):
        return Lost("the batch in another order", "permuted", dim, new, weak=bool(tag & WEAK))
    return tr.lost("index_select along the batch dimension", tag)


def _rows_of_batch(tr: Tracker, x: Tensor, index: Any, d: int, at: int, xtag: int,
                   order: Optional[Tensor] = None) -> Any:
    """``x[index]`` slicing the batch dim ``d`` (to dim ``at`` of the result): some of the batch's rows,
    each one sample's (a micro-batch cut from a draw), a ``Lost`` of kind "rows" saying which (of ``order``,
    the samples of x's rows, when x holds some of the batch's rows already)."""
    shape = [1] * x.ndim
    shape[d] = x.shape[d]
    picked = torch.arange(x.shape[d]).view(shape).expand(x.shape)[index]
    rows = picked.movedim(at, 0).reshape(picked.shape[at], -1) if picked.ndim else picked.reshape(1, 1)
    if tr.n <= 1 or rows.shape[1] == 0 or xtag & ~(DIM | WEAK):  # (a batch merged with another dim: lost)
        return tr.lost("slices part of the batch", xtag)
    chosen = rows[:, 0].clone() if order is None else order[rows[:, 0]]
    return Lost("slices part of the batch", "rows", at, chosen, weak=bool(xtag & WEAK))


RULES: Dict[str, Callable] = {
    "__getitem__": _getitem, "__setitem__": _setitem, "index_select": _index_select,
    "gather": _gather, "take_along_dim": _gather, "scatter": _gather, "scatter_add": _gather, "scatter_reduce": _gather,
    "scatter_": _gather, "scatter_add_": _gather, "scatter_reduce_": _gather, "index_add": _gather, "index_copy": _gather,
    "index_fill": _gather, "index_add_": _gather, "index_copy_": _gather, "index_fill_": _gather, "take": _take,
}
