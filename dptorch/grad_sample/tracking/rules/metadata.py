"""Operations whose result carries no data of the batch: metadata queries, factories shaped like their input."""

from __future__ import annotations

from typing import Callable, Dict


def skip(tr, func, args, kwargs):  # identity marker: no tensor result to tag
    return func(*args, **kwargs)


def untagged(tr, func, args, kwargs):
    """Factories shaped like their input (``zeros_like``, ``new_zeros``): no data of the batch."""
    return tr.run(func, args, kwargs)


_SKIP = """
size dim ndimension numel nelement item tolist numpy data_ptr stride storage_offset is_contiguous element_size
__len__ __bool__ __index__ __int__ __float__ __complex__ __format__ __repr__ __hash__ __reduce_ex__ __deepcopy__
__setstate__ __getstate__ __array__ __iter__ __contains__ register_hook retain_grad untyped_storage
storage is_floating_point is_complex is_signed get_device is_pinned is_shared is_set_to type_as_ __dir__
__sizeof__ _is_view is_nonzero has_names is_inference is_same_size dim_order __array_wrap__
"""

_UNTAGGED = """
zeros_like ones_like empty_like full_like rand_like randn_like randint_like new_zeros new_ones new_empty new_full
new_tensor new_empty_strided
"""


RULES: Dict[str, Callable] = {**{n: skip for n in _SKIP.split()}, **{n: untagged for n in _UNTAGGED.split()}}
