"""Operations whose result carries no data of the batch: metadata queries, factories shaped like their input.

Reading values out of torch is not metadata: ``escapes.py`` has those."""

from __future__ import annotations

from typing import Callable, Dict

from dptorch.grad_sample.tracking.args import op_name, tensors_of
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


_SKIP = """
size dim ndimension numel nelement data_ptr stride storage_offset is_contiguous element_size __len__ __bool__
__format__ __repr__ __hash__ __setstate__ __iter__ __contains__ retain_grad is_floating_point is_complex is_signed
get_device is_pinned is_shared is_set_to type_as_ __dir__ __sizeof__ _is_view is_nonzero has_names is_inference
is_same_size dim_order __array_wrap__
"""

_UNTAGGED = """
zeros_like ones_like empty_like full_like rand_like randn_like randint_like new_zeros new_ones new_empty new_full
new_empty_strided
"""


RULES: Dict[str, Callable] = {**{n: skip for n in _SKIP.split()}, **{n: untagged for n in _UNTAGGED.split()}}
