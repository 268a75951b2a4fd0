"""Packed sequences: pack_padded_sequence and pad_packed_sequence."""

from __future__ import annotations

from typing import Callable, Dict

from dptorch.grad_sample.tracking.args import Tracker, arg
from dptorch.grad_sample.tracking.tags import PACKED, packed
from dptorch.grad_sample.tracking.tags import WEAK, Lost


def _pad_packed(tr: Tracker, func, args, kwargs):
    data = args[0]
    dim = 0 if bool(arg(args, kwargs, 2, "batch_first", False)) else 1
    tag = tr.get(data)
    out = tr.run(func, args, kwargs)
    if type(tag) is Lost and tag.kind == "packed":
        # rows in the packed (sorted) order; pad_packed_sequence gathers them back with unsorted_indices
        tr.put(out[0], dim if tag.order is None else Lost("the batch in sorted order", "permuted", dim, tag.order))
    elif tag is not None:
        tr.put(out[0], tag if type(tag) is tuple else tr.lost("pads data that is not a PackedSequence's"))
    return out


def _pack_padded(tr: Tracker, func, args, kwargs):
    x = args[0]
    dim = 0 if bool(arg(args, kwargs, 2, "batch_first", False)) else 1
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if type(tag) is int and (tag & ~WEAK) == dim:
        tr.put(out[0], PACKED)
    elif type(tag) is Lost and tag.kind == "permuted" and tag.dim == dim:
        tr.put(out[0], packed(tag.order))
    elif tag is not None:
        tr.put(out[0], tr.lost("packs a tensor whose batch is not where pack_padded_sequence expects it"))
    return out


RULES: Dict[str, Callable] = {"_pad_packed_sequence": _pad_packed, "_pack_padded_sequence": _pack_padded}
