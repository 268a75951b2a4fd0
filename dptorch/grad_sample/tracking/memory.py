"""Which memory holds batch data: a tag follows the storage, not only the tensor object.

The tracker tags the tensors that torch operations return. A tensor can also be made without an
operation the tracker sees, aliasing memory it tagged: the legacy constructor ``torch.Tensor(t)``,
``torch.from_dlpack(t)``, a view made under ``torch._C.DisableTorchFunction``. Such an alias
would look untagged, so shared by all samples. This index keeps, per storage address, the tagged
tensors that live in it, so that an untagged tensor in that memory takes the tag of the tagged
tensor with its very layout (the same data, seen the same way), or is ``Lost`` (another view of
batch data, whose rows the tracker cannot place).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

from torch import Tensor
from torch.nn import Parameter

from dptorch.grad_sample.tracking.tags import Lost
from dptorch.grad_sample.tracking.writes import derived, storage_key

_ALIAS_REASON = ("memory holding batch data, seen through a tensor made where the batch tracker could not follow "
                 "(the legacy constructor torch.Tensor(t), DLPack, an operation with torch functions disabled)")


def _layout(t: Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


class BatchMemory:
    """Storage address -> the tensors tagged as derived from the batch that live there."""

    def __init__(self) -> None:
        self._held: Dict[int, List["weakref.ref[Tensor]"]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def note(self, t: Tensor, tag: Any) -> None:
        """``t`` was tagged ``tag``: remember its memory if the tag says batch data."""
        if derived(tag):
            key = storage_key(t)
            if key is not None:
                self._held.setdefault(key, []).append(weakref.ref(t))

    def holds(self, t: Tensor) -> bool:
        """Whether ``t``'s memory may hold batch data (a quick test; ``tag_of`` decides). A parameter's does
        not: it was made before the forward, and ``p.data = v`` tags ``p`` itself."""
        return type(t) is not Parameter and storage_key(t) in self._held

    def tag_of(self, t: Tensor, tag_of_tagged: Callable[[Tensor], Any]) -> Optional[Any]:
        """The tag of an untagged ``t``: that of the tagged tensor laid out as ``t`` in the same memory, a
        ``Lost`` if tagged batch data lives there otherwise, None if none does."""
        if type(t) is Parameter:
            return None
        key = storage_key(t)
        refs = self._held.get(key) if key is not None else None
        if not refs:
            return None
        found: Any = None
        for ref in refs:
            other = ref()
            if other is None or other is t or storage_key(other) != key:
                continue
            tag = tag_of_tagged(other)
            if not derived(tag):
                continue
            if _layout(other) == _layout(t):
                return tag
            found = found or Lost(_ALIAS_REASON)
        return found

    def take(self, other: "BatchMemory") -> None:
        """Hold ``other``'s memory too (a tracker continuing another's table)."""
        for key, refs in other._held.items():
            self._held.setdefault(key, []).extend(refs)

    def clear(self) -> None:
        self._held.clear()
