"""Checks that read tensor values: made at once in an eager step, after the replay in a captured one.

A few of the controller's proofs compare numbers it computed (an origin call's per-sample gradients
against their total, ``tracking/origins.py``). Eagerly that is a host read and a raise. A captured
step (``dptorch.optim.captured_step``) is traced on fake tensors, which have no values: there each
check's boolean becomes an output of the graph, and the step reads them all after every replay,
raising the first failed check's error before the round's clipped sums are kept (fail closed).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Tuple

import torch

Check = Tuple[torch.Tensor, Callable[[], Exception]]

_DEFERRED: List[List[Check]] = []  # the checks of the captures under way, innermost last


def require(ok: torch.Tensor, error: Callable[[], Exception]) -> None:
    """Raise ``error()`` unless the boolean tensor ``ok`` holds: now, or after the captured step's replay."""
    if _DEFERRED:
        _DEFERRED[-1].append((ok.reshape(()), error))
    elif not bool(ok):
        raise error()


@contextlib.contextmanager
def deferred() -> Iterator[List[Check]]:
    """Collect the checks made inside (a trace) instead of reading them: the caller makes them graph outputs."""
    checks: List[Check] = []
    _DEFERRED.append(checks)
    try:
        yield checks
    finally:
        _DEFERRED.remove(checks)


def raise_failed(passed: List[bool], errors: List[Callable[[], Exception]]) -> None:
    """After a replay: raise the first failed check's error (``passed`` read back from the graph's outputs)."""
    for ok, error in zip(passed, errors):
        if not ok:
            raise error()
