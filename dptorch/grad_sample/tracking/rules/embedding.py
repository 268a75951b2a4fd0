"""Embeddings: lookups keep the batch of their indices."""

from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import Tensor

from dptorch.grad_sample.tracking.args import Tracker, arg
from dptorch.grad_sample.tracking.rules.structural import structural
from dptorch.grad_sample.tracking.tags import DIM
from dptorch.grad_sample.tracking.writes import derived


def _d_leading(d, shape, args, kwargs, out):  # embedding, one_hot: new trailing dims
    return d


def _embedding_bag(tr: Tracker, func, args, kwargs):
    x = arg(args, kwargs, 0, "input")
    offsets = arg(args, kwargs, 2, "offsets")
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    result = out[0] if isinstance(out, tuple) else out
    if x.ndim == 2:
        new = tag if type(tag) is not int or tag & DIM == 0 else tr.lost("embedding_bag across the batch", tag)
    else:
        otag = tr.get(offsets) if isinstance(offsets, Tensor) else None
        new = otag if type(otag) is int and otag & DIM == 0 else (tag if tag is None or type(tag) is tuple else tr.lost("embedding_bag of flat indices", tag))
    weights = [tr.get(t) for t in (arg(args, kwargs, 1, "weight"), arg(args, kwargs, 8, "per_sample_weights"))
               if isinstance(t, Tensor)]
    mixed = [g for g in weights if derived(g) and g != tag]
    if mixed:
        new = tr.lost_from("embedding_bag with weights derived from the batch (not batched as its input is)", mixed)
    tr.put(result, new)
    return out


def _torch_embedding(tr, func, args, kwargs):  # torch.embedding(weight, indices, ...)
    weight, indices = args[0], args[1]
    tag = tr.get(indices)
    out = tr.run(func, args, kwargs)
    wtag = tr.get(weight)
    if wtag is not None and type(wtag) is not tuple:
        tr.put(out, tr.lost("embedding of weights derived from the batch"))
    elif tag is not None:
        tr.put(out, tag)
    elif wtag is not None:
        tr.put(out, wtag)
    return out


RULES: Dict[str, Callable] = {
    "embedding": structural(_d_leading), "F.embedding": structural(_d_leading), "one_hot": structural(_d_leading),
    "torch.embedding": _torch_embedding, "embedding_bag": _embedding_bag,
}
