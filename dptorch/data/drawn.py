"""The tensors of the batch a DP data loader handed out last.

The loss may use parts of the batch the model never sees (the labels of ``loss_fn(model(x), y)``,
a count of them as divisor). The DP loaders record each batch here as they hand it out, and the
controller tags its tensors as batched along dim 0 (the dim they were collated along) when the
next root forward starts, so that the tracker follows them into the loss too. Weak references
only: nothing of the data is kept alive.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, List, Sequence

import torch
from torch.utils._pytree import tree_flatten

_LATEST: List["weakref.ref[torch.Tensor]"] = []
_WATCHERS: List[Callable[[List[torch.Tensor]], None]] = []
_LET_GO: List[Callable[[], None]] = []
_COUNT = [0]  # batches handed out so far: the latest one's number


def watch(callback: Callable[[List[torch.Tensor]], None]) -> None:
    """Call ``callback`` with the tensors of every batch handed out from now on (the batch tracker's
    watch: what the training loop derives from them before the forward is followed too)."""
    if callback not in _WATCHERS:
        _WATCHERS.append(callback)


def on_let_go(callback: Callable[[], None]) -> None:
    """Call ``callback`` when the iterator that handed out the latest batch is dropped (see ``let_go``)."""
    if callback not in _LET_GO:
        _LET_GO.append(callback)


def hand_out(batch: Any) -> int:
    """Record ``batch`` (any nesting of tensors) as the latest batch handed to the training loop; returns its
    number (for ``let_go``)."""
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    _LATEST[:] = [weakref.ref(t) for t in tensors]
    _COUNT[0] += 1
    for callback in _WATCHERS:
        callback(tensors)
    return _COUNT[0]


def let_go(number: int) -> None:
    """The iterator that handed out batch ``number`` was dropped (a loop left by ``break``, a fixed number of
    steps): if that batch is still the latest, the loop derives nothing more from it through the loader, and
    the watchers may stop following it. The batch stays the latest (its labels may still reach a loss)."""
    if number == _COUNT[0]:
        for callback in _LET_GO:
            callback()


def latest() -> List[torch.Tensor]:
    """The latest batch's tensors that are still alive."""
    return [t for t in (ref() for ref in _LATEST) if t is not None]


@contextlib.contextmanager
def standing_in(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside, ``tensors`` are the latest batch and the watchers follow them as a hand-out's: a captured step's
    trace, whose fake tensors stand for the batch the loader handed out. The batch before is the latest again
    after (its watchers are not restarted: the caller stops what followed the stand-ins)."""
    saved = list(_LATEST)
    _LATEST[:] = [weakref.ref(t) for t in tensors]
    try:
        for callback in _WATCHERS:
            callback(list(tensors))
        yield
    finally:
        _LATEST[:] = saved
