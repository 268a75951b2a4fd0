"""The draw's watch: from a DP loader's hand-out to the root forwards, what derives from the batch drawn.

A training loop often makes copies of the batch before the forward (``y.clone()``, ``x.to(device)``,
``F.one_hot(y)``, a second model input ``x * 1``), cuts it into micro-batches (``x[:4]``), reads its
size (``len(y)``) or mixes it (``x - x.mean(0)``). Tagged only at the root call, such a tensor would
be of unknown origin. So when a DP loader hands out a batch (``data/drawn.py``), a tracker starts at
the bottom of torch's mode stack and follows the batch's tensors (batched along dim 0, the dim they
were collated along). Each capturing root forward adopts what it learnt: the tensors derived from the
draw (batched, some of its rows, or ``Lost`` where they were mixed), the batch sizes and values read
into Python. A root argument it did not see derived from the draw is then shared by the samples, not a
weak guess. The watch pauses while a forward and its loss are followed by the controller's tracker,
and goes on after their backward (the next micro-batch of the same draw).

The watch refuses nothing itself (a value read, a backward of another model): it only tags. It
runs only while some controller is attached, and stops at the next hand-out, or when the
controllers detach.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Tuple

from torch import Tensor

from dptorch.grad_sample.tracking.mode import BatchTracker
from dptorch.grad_sample.tracking.stack import remove, sink

_WATCH: List[BatchTracker] = []  # the running watch, at most one


def start(tensors: List[Tensor], active: Callable[[], bool]) -> None:
    """A DP loader handed out ``tensors``: watch them (if ``active()``: a controller is attached)."""
    stop()
    rows = [t for t in tensors if t.dim()]
    if not rows or not active():
        return
    n = rows[0].shape[0]
    tracker = BatchTracker(n, skip=lambda: False, quiet=contextlib.nullcontext)
    tracker.forward_done = True  # outside a forward: values read out are recorded, not refused
    tracker.checks_backward = False  # another model's backward on the batch is not this library's
    for t in rows:
        if t.shape[0] == n:
            tracker.put(t, 0)
    sink(tracker)
    _WATCH.append(tracker)


def pause() -> Tuple[Optional[BatchTracker], bool]:
    """A root forward starts: the watch (None if none runs), paused until ``resume``, for the forward's
    tracker to adopt what it learnt; and whether it saw the whole way from the draw (it was not paused
    already: an earlier forward of the draw without a backward leaves a gap it did not follow)."""
    if not _WATCH:
        return None, False
    whole = not _WATCH[0].paused
    _WATCH[0].paused = True
    return _WATCH[0], whole


def resume() -> None:
    """The forward's loss was back-propagated: follow the draw again (the next micro-batch of it)."""
    if _WATCH:
        _WATCH[0].paused = False


def stop() -> None:
    """End the watch, forgetting what it learnt."""
    if _WATCH:
        tracker = _WATCH.pop()
        remove(tracker)
        tracker.close()
