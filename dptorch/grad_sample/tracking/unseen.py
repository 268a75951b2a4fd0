"""Operations the batch tracker cannot see: run with torch functions switched off.

The tracker is a ``TorchFunctionMode``: it sees torch's Python API. Under
``torch._C.DisableTorchFunction()`` (or ``torch._C._set_torch_function_state``) no mode sees anything,
so ``x.mean(0)`` computed there would come out untagged, a tensor shared by all samples, and
``x - that`` would carry every sample into every other's gradient. What still sees such an
operation is torch's dispatcher: a ``TorchDispatchMode`` is called for each ATen operation whatever
the Python level says.

``UnseenOps`` is that mode. It sits at the bottom of torch's dispatch-mode stack while a batch
tracker follows the loop (the draw's watch, a root forward, its loss), and leaves it for backward and
the optimizer's step. For an operation run with torch functions on it does nothing; one run with
them switched off, on a tensor that derives from the batch (its tag, or its memory's) or that has a
gradient (a parameter's path the controller would not see), is refused. Operations on other tensors
(constants, shapes) run.
"""

from __future__ import annotations

import weakref
from typing import Any, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch._C import DisableTorchFunction as _DisableTorchFunction

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tracking.writes import derived


class UnseenOps(TorchDispatchMode):
    """Refuses an ATen operation on batch data that no batch tracker saw (torch functions switched off)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if torch._C._is_torch_function_all_disabled():
            _check(func, args, kwargs)
        with _DisableTorchFunction():  # the operation itself, which function modes saw already (or cannot see)
            return func(*args, **kwargs)


GUARD = UnseenOps()


_TRACKERS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every batch tracker made (the watch, root forwards, losses)


def register(tracker: Any) -> None:
    """A batch tracker was made: while it follows the loop (not done, not paused), the guard is on."""
    _TRACKERS.add(tracker)


def _live_trackers() -> List[Any]:
    """The batch trackers that follow the loop now. Not read from torch's function-mode stack: inside a mode's
    ``__torch_function__`` (where backward is called) torch takes the running modes off it."""
    return [t for t in list(_TRACKERS) if not t.done and not t.paused and t.n > 1]


def _tensors(values: Any) -> List[torch.Tensor]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(t for t in v if isinstance(t, torch.Tensor))
    return found


def _check(func: Any, args: tuple, kwargs: dict) -> None:
    trackers = _live_trackers()
    if not trackers:
        return
    for t in _tensors((*args, *kwargs.values())):
        what = "a tensor with a gradient" if t.requires_grad else None
        if what is None and any(derived(tr.get(t)) for tr in trackers):
            what = "batch data"
        if what is not None:
            raise PerSampleGradientError(
                f"{func} ran on {what} with torch functions switched off (torch._C.DisableTorchFunction): the batch "
                "tracker cannot follow it, so it could mix the samples, or give a parameter gradient by a path the "
                "controller does not see. Run it with torch functions on. Nothing was updated.")


def _on_stack() -> bool:
    return any(torch._C._get_dispatch_stack_at(i) is GUARD for i in range(torch._C._len_torch_dispatch_stack()))


def _replace_dispatch_stack(modes: List[Any]) -> None:
    while torch._C._len_torch_dispatch_stack():
        torch._C._pop_torch_dispatch_stack(None)
    for mode in modes:
        torch._C._push_on_torch_dispatch_stack(mode)


def follow() -> None:
    """Put the guard at the bottom of the dispatch-mode stack if a batch tracker follows the loop now, take it
    off otherwise."""
    if _live_trackers():
        if not _on_stack():
            modes = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
            _replace_dispatch_stack([GUARD] + modes)
    else:
        off()


def off() -> None:
    """Take the guard off the dispatch-mode stack (backward, the optimizer's step: nothing of the loop runs)."""
    if _on_stack():
        modes = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
        _replace_dispatch_stack([m for m in modes if m is not GUARD])
