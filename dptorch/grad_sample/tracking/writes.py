"""In-place writes: a tag describes a tensor's memory, and every alias of that memory must agree.

A tag is set when a tensor is made; views made later from it get tags derived from it. When an
in-place operation (``x.add_(y)``, ``x[i] = y``, ``out=``) writes into memory that other tensors
alias (the base of a view, sibling views of one base), their tags may no longer say what their
memory holds. A write is *benign* when the written tensor keeps its batch tag (each sample's rows
received only that sample's data, so every alias derived from it is still right) or when neither
the old nor the new contents derive from the batch. Any other write (a mix of rows, batch data
into a shared tensor, a batch tag moved) makes every other tagged alias of that memory ``Lost``,
and an untagged alias read later is ``Lost`` too: the memory is *dirty* for the rest of the
forward.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

from torch import Tensor
from torch._C import DisableTorchFunction
from torch._subclasses.fake_tensor import FakeTensor

from dptorch.grad_sample.tracking.args import Tracker, any_tensor
from dptorch.grad_sample.tracking.tags import DIM, KEEP, Lost

_DIRTY_REASON = ("memory that an in-place write (an operation the tracker could not prove per-sample, or batch "
                 "data written into a shared tensor) changed behind this alias")


def storage_key(t: Tensor) -> Optional[int]:
    """The address of ``t``'s memory (None when it has none to alias: no storage, or no elements). A fake tensor
    (a captured step's trace) has no address: its storage object stands for its memory (views share it)."""
    try:
        with DisableTorchFunction():  # the tracker's own look, not a read of the values
            storage = t.untyped_storage()
            # data_ptr raises for storage freed under it (FSDP2's resharded parameters), and for a fake tensor's
            ptr = storage._cdata if isinstance(t, FakeTensor) else storage.data_ptr()
            return ptr if ptr and storage.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def is_inplace(name: str) -> bool:
    """Whether an operation of this name writes into its first argument (torch's naming)."""
    return (name.endswith("_") and not name.startswith("_")) or name in ("__setitem__", "__set__") or (
        name.startswith("__i") and name.endswith("__") and name not in ("__init__", "__index__", "__int__", "__iter__",
                                                                      "__invert__"))


def written(func: Any, args: tuple, kwargs: dict) -> List[Tensor]:
    """The tensors an operation writes into: its first argument if it works in place, and ``out=``."""
    name = getattr(func, "__name__", "") or ""
    targets = [args[0]] if args and isinstance(args[0], Tensor) and is_inplace(name) else []
    out = kwargs.get("out")
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(t, Tensor):
            targets.append(t)
    return targets


def derived(tag: Any) -> bool:
    """Whether a tag says the data derives from the batch (batched or lost)."""
    return type(tag) is int or type(tag) is Lost


def benign(old: Any, new: Any) -> bool:
    """Whether a write that changed a tensor's tag from ``old`` to ``new`` leaves its aliases right."""
    if type(old) is int:
        return new == old
    return not derived(old) and not derived(new)


class Writes:
    """The dirty memory of one forward: address -> (the storage, kept alive so that its address is
    not reused while the forward runs; why it is dirty); and the untagged tensors written since."""

    def __init__(self) -> None:
        self.dirty: Dict[int, Tuple[Any, str]] = {}
        self.rewritten: Dict[int, Any] = {}  # id -> weakref of a tensor whose untagged contents are fresh

    def wrote(self, tr: Tracker, target: Tensor, old: Any, new: Any, reason: Optional[str] = None) -> None:
        """``target`` was written in place; its tag was ``old`` and is now ``new``."""
        if benign(old, new) or tr.n <= 1:
            tr.put(target, new)
            return
        base = target._base
        base_old = tr.get(base) if base is not None else None
        key = storage_key(target)
        if key is not None:
            lost = Lost(f"{_DIRTY_REASON}: {reason or _what(new)}")
            for ref, _ in list(tr._table.values()):
                t = ref()
                if t is not None and t is not target and t is not base and storage_key(t) == key:
                    tr.put(t, lost)
            self.dirty[key] = (target.untyped_storage(), lost.reason)
        tr.put(target, new)
        if new is None:
            self.rewritten[id(target)] = weakref.ref(target)
        if base is not None:
            tr.put(base, _base_tag(tr, base, base_old, target, new))

    def fresh(self, t: Tensor) -> bool:
        """Whether ``t`` was written with shared values over batch data (its contents are its own now)."""
        ref = self.rewritten.get(id(t))
        return ref is not None and ref() is t

    def untagged(self, t: Tensor) -> Optional[Lost]:
        """The tag of an untagged tensor that was not itself rewritten (``fresh``): ``Lost`` if it aliases
        dirty memory."""
        key = storage_key(t)
        entry = self.dirty.get(key) if key is not None else None
        return None if entry is None else Lost(entry[1])

    def touches(self, args: tuple, kwargs: dict) -> bool:
        """Whether an operation's tensor arguments alias dirty memory."""
        return any_tensor(args, kwargs, lambda t: storage_key(t) in self.dirty)

    def clear(self) -> None:
        self.dirty.clear()
        self.rewritten.clear()


def _base_tag(tr: Tracker, base: Tensor, old: Any, view: Tensor, new: Any) -> Any:
    """The tag of ``base`` (tagged ``old``) after a write made its ``view`` tagged ``new``: batched
    where the stride of the view's batch dim says which dim of the base it is, else ``Lost``."""
    if type(new) is int:
        d = new & DIM
        candidates = [j for j in range(base.ndim) if base.stride(j) == view.stride(d) and base.shape[j] == view.shape[d]]
        if len(candidates) == 1 and (not derived(old) or (type(old) is int and old & DIM == candidates[0])):
            return (new & KEEP) | candidates[0]
        if type(old) is int and old & DIM in candidates:
            return old
        return tr.lost("an in-place write of batched values into a view of a shared tensor", new)
    if type(new) is Lost:
        return new
    return tr.lost("an in-place write of shared values over batch data, into a view", old)


def _what(new: Any) -> str:
    if type(new) is Lost:
        return new.reason
    if new is None:
        return "shared values written over batch data"
    return "batch data written into it"
