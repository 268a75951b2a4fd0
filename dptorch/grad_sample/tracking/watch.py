"""The draw's watch: from a DP loader's hand-out to the root forwards, what derives from the batch drawn.

A training loop often makes copies of the batch before the forward (``y.clone()``, ``x.to(device)``,
``F.one_hot(y)``, a second model input ``x * 1``), cuts it into micro-batches (``x[:4]``), reads its
size (``len(y)``) or mixes it (``x - x.mean(0)``). Tagged only at the root call, such a tensor would
be of unknown origin. So when a DP loader hands out a batch (``data/drawn.py``), a tracker starts at
the bottom of torch's mode stack and follows the batch's tensors (batched along dim 0, the dim they
were collated along). Each capturing root forward adopts what it learnt: the tensors derived from the
draw (batched, some of its rows, or ``Lost`` where they were mixed), the batch sizes and values read
into Python. A root argument it did not see derived from the draw is then shared by the samples, not a
weak guess. The watch leaves torch's mode stack during a forward, waits while its loss and backward
are followed by the controller, and goes on after that backward (the next micro-batch of the same
draw); the optimizer's step is set aside (``aside``).

The watch refuses nothing itself (a value read, a backward of another model): it only tags. It
runs only while some controller is attached, and stops at the next hand-out, at the end of the
loader's pass, when the loop drops the loader's iterator after a forward and backward of the draw
(``let_go``: a ``break``, a fixed number of steps; for a batch taken by ``next(iter(loader))``, at
the optimizer's step that closes its draw), or when the controllers detach. Stopping early is
never less private: a root forward without a watch takes an argument it cannot place as batched.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional, Tuple

from torch import Tensor

from dptorch.grad_sample.tracking.mode import BatchTracker
from dptorch.grad_sample.tracking.stack import on_stack, remove, sink
from dptorch.grad_sample.tracking.unseen import follow as follow_unseen

_WATCH: List[BatchTracker] = []  # the running watch, at most one
_OFF: List[BatchTracker] = []  # the watch while it is off the mode stack (during a forward)
_SERVED: List[bool] = [False]  # whether a forward and its backward of the draw ran under the running watch
_LET_GO: List[bool] = [False]  # whether the loop dropped the iterator that handed out the draw


def start(tensors: List[Tensor], active: Callable[[], bool]) -> None:
    """A DP loader handed out ``tensors``: watch them (if ``active()``: a controller is attached)."""
    stop()
    _SERVED[0] = _LET_GO[0] = False
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


def following() -> bool:
    """Whether a watch follows the loop now (not paused by a forward or the step, not stopped)."""
    return bool(_WATCH) and not _WATCH[0].paused and not _WATCH[0].done


def pause() -> Tuple[Optional[BatchTracker], bool]:
    """A root forward starts: the watch (None if none runs) leaves torch's mode stack until ``rest`` (a
    mode there costs every operation of the forward a dispatch), paused until ``resume``, for the forward's
    tracker to adopt what it learnt; and whether it saw the whole way from the draw (it was not paused
    already: an earlier forward of the draw without a backward leaves a gap it did not follow)."""
    if not _WATCH:
        return None, False
    watch = _WATCH[0]
    whole = not watch.paused
    watch.paused = True
    if not _OFF:
        remove(watch)
        _OFF.append(watch)
    return watch, whole


def rest() -> None:
    """The forward ended: the watch goes back to the bottom of the stack, still paused (its loss and
    backward are the controller's to follow). Only outside a mode's ``__torch_function__``."""
    if _OFF:
        sink(_OFF.pop())


def resume() -> None:
    """The forward's backward is over: follow the loop again (the next micro-batch of the draw)."""
    if _WATCH:
        _WATCH[0].paused = False
        _SERVED[0] = True
        follow_unseen()


def let_go() -> None:
    """The loop dropped the iterator that handed out the watched draw. Stop now if a forward and backward of
    the draw ran; otherwise (``next(iter(loader))``: the batch is still to be trained on, maybe in micro-batches)
    at the optimizer's step that closes the draw (``draw_closed``)."""
    _LET_GO[0] = True
    if _SERVED[0]:
        _stop_if_on_stack()


def draw_closed() -> None:
    """The optimizer's step closed the draw: stop if the loop already dropped the iterator it came from."""
    if _LET_GO[0]:
        _stop_if_on_stack()


def _stop_if_on_stack() -> None:
    """Stop, if the watch sits on the mode stack: not during a forward, the optimizer's step or the watch's
    own ``__torch_function__`` (where a garbage collection may drop an iterator); then the next hand-out
    stops it."""
    if _WATCH and on_stack(_WATCH[0]):  # off it during a forward (``pause``) and the step (``aside``)
        stop()


@contextlib.contextmanager
def aside() -> Iterator[None]:
    """The library's own work between two forwards (the optimizer's step): nothing of it is the loop's, and
    the watch leaves the mode stack meanwhile (a mode there costs every operation a dispatch). Only outside a
    mode's ``__torch_function__``."""
    watch = _WATCH[0] if _WATCH and not _OFF else None
    paused = watch is not None and watch.paused
    if watch is not None:
        watch.paused = True  # and the guard of unseen operations is off meanwhile (unseen.py)
        remove(watch)
    try:
        yield
    finally:
        if watch is not None and _WATCH and _WATCH[0] is watch:
            watch.paused = paused
            sink(watch)


def stop() -> None:
    """End the watch, forgetting what it learnt."""
    if _WATCH:
        tracker = _WATCH.pop()
        if _OFF:
            _OFF.pop()
        else:
            remove(tracker)
        tracker.close()
        follow_unseen()  # the guard of unseen operations leaves with the last tracker that follows the loop
