"""Operations whose result carries no data of the batch: metadata queries, factories shaped like their input.

Reading values out of torch is not metadata: ``escapes.py`` has those."""

from __future__ import annotations

from typing import Callable, Dict

from dptorch.grad_sample.tracking.args import caller, is_library, norm_dim, op_name, tensors_of
from dptorch.grad_sample.tracking.tags import DIM
from dptorch.grad_sample.tracking.writes import derived


def skip(tr, func, args, kwargs):  # identity marker: no tensor result to tag
    return func(*args, **kwargs)


def untagged(tr, func, args, kwargs):
    """Factories shaped like their input (``zeros_like``, ``new_zeros``): no data of the batch, unless
    another tensor argument (a fill value) derives from it."""
    fills = [tr.get(t) for where, t in tensors_of(args, kwargs) if where != ("a", 0)]
    out = tr.run(func, args, kwargs)
    if any(derived(g) for g in fills):
        tr.put_all(out, tr.lost_from(f"{op_name(func)} filled with a value derived from the batch", fills))
    return out


def count(tr, func, args, kwargs):
    """A size read (``len(y)``, ``x.shape``, ``x.size(0)``, ``numel``): outside the forward, reading the batch
    size of a batched tensor is recorded (``tracker.counted``), for a loss scaled by a number after it may
    be divided by the batch size (``loss.py``). Inside the forward, shapes are read to compute, not scale."""
    out = func(*args, **kwargs)
    if tr.forward_done and tr.counted is None and args and tr.n > 1:
        tag = tr.get(args[0])
        if type(tag) is int and _reads_batch(op_name(func), args, kwargs, tag & DIM) and not is_library(caller()):
            tr.counted = f"{_what(func)} of a tensor that carries the batch (the number of samples drawn)"
    return out


def _reads_batch(name: str, args: tuple, kwargs: dict, dim: int) -> bool:
    if name == "__len__":
        return dim == 0
    if name == "size":
        d = args[1] if len(args) > 1 else kwargs.get("dim")
        return d is None or norm_dim(int(d), args[0].ndim) == dim
    return True  # the whole shape, numel


def _what(func) -> str:
    name = op_name(func)
    if name == "__get__":
        return "x.shape"
    return {"__len__": "len()"}.get(name, f"{name}()")


_SKIP = """
dim ndimension data_ptr stride storage_offset is_contiguous element_size __bool__
__hash__ __setstate__ __iter__ __contains__ retain_grad is_floating_point is_complex is_signed
get_device is_pinned is_shared is_set_to type_as_ __dir__ __sizeof__ _is_view is_nonzero has_names is_inference
is_same_size dim_order __array_wrap__
"""

_UNTAGGED = """
zeros_like ones_like empty_like full_like rand_like randn_like randint_like new_zeros new_ones new_empty new_full
new_empty_strided
"""


RULES: Dict[str, Callable] = {**{n: skip for n in _SKIP.split()}, **{n: untagged for n in _UNTAGGED.split()},
                              **{n: count for n in ("size", "numel", "nelement", "__len__", "get:shape")}}
