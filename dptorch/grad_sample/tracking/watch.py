"""The draw's watch: from a DP loader's hand-out to the root forward, what derives from the batch drawn.

A training loop often makes copies of the batch before the forward (``y.clone()``, ``x.to(device)``,
``F.one_hot(y)``, a second model input ``x * 1``), reads its size (``len(y)``) or mixes it
(``x - x.mean(0)``). Tagged only at the root call, such a copy would be a tensor of unknown origin.
So when a DP loader hands out a batch (``data/drawn.py``), a tracker starts at the bottom of torch's
mode stack and follows the batch's tensors (batched along dim 0, the dim they were collated along)
until the next capturing root forward, which adopts what it learnt: the tensors derived from the
draw (batched, or ``Lost`` where they were mixed), the batch sizes and values read into Python.
A root argument it did not see derived from the draw is then shared by the samples, not a weak guess.

The watch refuses nothing itself (a value read, a backward of another model): it only tags. It
runs only while some controller is attached, and stops at the forward, at the next hand-out, or
when the controllers detach.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

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


def take() -> Optional[BatchTracker]:
    """End the watch (a root forward starts and adopts it): the watch's tracker, or None."""
    if not _WATCH:
        return None
    tracker = _WATCH.pop()
    remove(tracker)
    tracker.done = True
    return tracker


def stop() -> None:
    """End the watch, forgetting what it learnt."""
    tracker = take()
    if tracker is not None:
        tracker.close()
