"""Reductions, scans and sorts along dims: the batch survives unless it is reduced or scanned over."""

from __future__ import annotations

from typing import Callable, Dict

from torch import Tensor

from dptorch.grad_sample.tracking.args import Tracker, arg, dims_arg, op_name
from dptorch.grad_sample.tracking.loss import batch_total
from dptorch.grad_sample.tracking.rules.elementwise import broadcast
from dptorch.grad_sample.tracking.rules.structural import dim_is_batch, structural
from dptorch.grad_sample.tracking.tags import DIM, KEEP, ORDERED, Lost, ordered_at


_KEEPDIM_AT = {"std": 3, "var": 3, "std_mean": 3, "var_mean": 3, "norm": 3, "median": 2, "nanmedian": 2, "mode": 2,
               "kthvalue": 3}
_DIM_AT = {"norm": 2, "kthvalue": 2}
_DEFAULT_DIM = {"mode": -1, "kthvalue": -1}


def reduction(tr: Tracker, func, args, kwargs):
    name = op_name(func)
    if name in ("max", "min") and len(args) > 1 and isinstance(args[1], Tensor):
        return broadcast(tr, func, args, kwargs)
    x = args[0] if args else kwargs.get("input")
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if tag is None:
        return out
    ordered = type(tag) is Lost and tag.kind in ORDERED
    if type(tag) is int or ordered:
        ndim = x.ndim
        dim = arg(args, kwargs, _DIM_AT.get(name, 1), "dim", kwargs.get("axis", _DEFAULT_DIM.get(name)))
        if isinstance(dim, bool) or isinstance(dim, str):  # std(unbiased), norm(p) overloads
            dim = kwargs.get("dim")
        keepdim = arg(args, kwargs, _KEEPDIM_AT.get(name, 2), "keepdim", False)
        keepdim = keepdim if isinstance(keepdim, bool) else False
        dims = dims_arg(dim, ndim)
        d = tag.dim if ordered else tag & DIM
        kept = d if keepdim else d - sum(1 for i in dims if i < d) if dims is not None else d
        over = dims is None or d in dims
        if ordered and over and tag.kind == "units":  # each entry one privacy unit's own: the units' total
            tag = batch_total(tr, name, 0, _averaged(x, out))
        elif ordered:  # some rows of the batch: reduced over them, plainly lost; otherwise the same rows
            tag = Lost(tag.reason, weak=tag.weak) if over else ordered_at(tag, kept)
        elif over:
            tag = batch_total(tr, name, tag, _averaged(x, out))
        else:
            tag = (tag & KEEP) | kept
    tr.put_all(out, tag)
    return out


def _averaged(x: Tensor, out: object) -> int:
    """How many entries of ``x`` each entry of the reduction ``out`` averages (a mean's divisor)."""
    first = out[0] if isinstance(out, (tuple, list)) else out
    return x.numel() // max(first.numel(), 1) if isinstance(first, Tensor) else x.numel()


_REDUCTIONS = """
sum nansum mean nanmean prod amax amin max min argmax argmin logsumexp norm std var std_mean var_mean all any
count_nonzero median nanmedian mode aminmax
"""


RULES: Dict[str, Callable] = {n: reduction for n in _REDUCTIONS.split()}
RULES.update({
    "cumsum": structural(dim_is_batch(1, "dim")), "cumprod": structural(dim_is_batch(1, "dim")),
    "cummax": structural(dim_is_batch(1, "dim")), "cummin": structural(dim_is_batch(1, "dim")),
    "logcumsumexp": structural(dim_is_batch(1, "dim")), "sort": structural(dim_is_batch(1, "dim", -1)),
    "argsort": structural(dim_is_batch(1, "dim", -1)), "msort": structural(dim_is_batch(1, "dim", 0)),
    "topk": structural(dim_is_batch(2, "dim", -1)), "kthvalue": reduction,
    "diff": structural(dim_is_batch(2, "dim", -1), aligned=(3, 4, "prepend", "append")),
    "cumsum_": structural(dim_is_batch(1, "dim"), inplace=True, writes=True),
    "cumprod_": structural(dim_is_batch(1, "dim"), inplace=True, writes=True),
})
