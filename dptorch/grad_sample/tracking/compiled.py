"""Code that torch.compile (Dynamo) traces or runs, met by the batch tracker: refused; a compiled model's
private forwards: run eagerly.

Dynamo compiles around a ``TorchFunctionMode`` whose ``__torch_function__`` breaks its graph, and in
torch 2.13 it can then run a graph compiled for one operation in place of another: under the tracker,
a compiled model forward (GPT-2's MLP block) came out 5e-2 off at batch size 1, and a compiled loss
``((o * 2.0) * 3.0 + 5.0).sum()`` gave -14.80 for 7.04. So every operation a live tracker follows (the
forward, its loss, the draw watch) refuses to run under Dynamo.

A model compiled after ``make_private(..., wrap_model=False)`` still trains: its root pre-hook runs outside
Dynamo, and where the forward it begins is followed (a training forward, or any forward while a DP loader's
draw is watched) it leaves Dynamo's frame callback off for the rest of the compiled call
(:func:`eager_when_followed`), so the forward runs as an eager one, under the tracker, with no graph
compiled around it; other calls (evaluation outside the loop) stay compiled. Dynamo traces nothing while
a tracker follows the forward, so the fault above, and a newer one of the same kind (a pass-through mode
across graph breaks: GPT-2's ``torch.arange(n, device=x.device)`` was called with ``device=torch.Size``,
torch 2.13, no dptorch involved), cannot reach the step.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, List

import torch

COMPILED_CODE = (
    "torch.compile runs code that dptorch's batch tracker follows (a compiled loss, or compiled code that meets the "
    "batch outside the model's forward while a DP loader's draw is watched, until the loop is done with it or the "
    "controller's cleanup()): Dynamo compiles around the tracker, and there torch 2.13 can run a graph compiled for "
    "one operation in place of another (measured: GPT-2's MLP block off by 5e-2 at batch size 1; a compiled loss "
    "((o * 2.0) * 3.0 + 5.0).sum() gave -14.80 for 7.04), a wrong gradient. Compile the model alone "
    "(torch.compile(model) after make_private(..., wrap_model=False): its private forward runs eagerly, with the "
    "rest of the compiled call it is part of; evaluation outside the loop runs compiled) and keep the loss uncompiled"
)


def under_torch_compile() -> bool:
    """Whether this call runs in code that torch.compile (Dynamo) traces or compiled: Dynamo's frame
    callback is set for the whole compiled call, graph breaks included (an untraceable call: it always
    runs eagerly)."""
    return torch.compiler.is_compiling() or torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)


_SET_EVAL_FRAME = torch._C._dynamo.eval_frame.set_eval_frame
_SAID: List[bool] = []


def eager_when_followed(pre_hook: Callable, followed: Callable[[], bool]) -> Callable:
    """The root pre-hook ``pre_hook``, run outside Dynamo; where the forward it begins is ``followed()`` (a
    training forward, or any forward while a DP loader's draw is watched) it leaves Dynamo's frame callback off,
    so the forward, and the rest of the compiled call it is part of, run eagerly under the tracker (torch.compile
    puts its callback back as the compiled call returns)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        prior = _SET_EVAL_FRAME(None)
        try:
            result = pre_hook(*args, **kwargs)
        except BaseException:
            _SET_EVAL_FRAME(prior)
            raise
        if prior in (None, False) or not followed():
            _SET_EVAL_FRAME(prior)
        else:
            _say_once()
        return result

    return _outside_dynamo(run)


def outside_dynamo(hook: Callable) -> Callable:
    """``hook`` run with Dynamo's frame callback off, as ``torch.compiler.disable`` does (without importing Dynamo):
    under torch.compile a controller's hook breaks the graph and runs as in an eager forward, never traced."""

    def run(*args: Any, **kwargs: Any) -> Any:
        prior = _SET_EVAL_FRAME(None)
        try:
            return hook(*args, **kwargs)
        finally:
            _SET_EVAL_FRAME(prior)

    return _outside_dynamo(run)


def _outside_dynamo(hook: Callable) -> Callable:
    """Mark ``hook`` so that Dynamo breaks its graph at the call and runs it as it is (``torch.compiler.disable``'s
    mark; the frame callback is managed by the hook itself)."""
    hook._torchdynamo_disable = True
    hook._torchdynamo_disable_msg = ("a hook of dptorch's controller, which runs eagerly: a private model is not one "
                                     "graph (compile it without fullgraph=True; its private forwards run eagerly)")
    skip_code = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
    if skip_code is not None:  # else Dynamo tries the hook's frame once (a warning of its own), then runs it
        skip_code(hook.__code__)
    return hook


def _say_once() -> None:
    if not _SAID:
        _SAID.append(True)
        warnings.warn("dptorch: the model is compiled (torch.compile), and its private forwards (training, and any "
                      "forward while a DP loader's draw is watched) run eagerly, under the batch tracker (a compiled "
                      "private step is not built yet: docs/performance.md, 'Compiled columns'); other calls run "
                      "compiled", stacklevel=3)
