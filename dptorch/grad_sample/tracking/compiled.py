"""Code that torch.compile (Dynamo) traces or runs, met by the batch tracker: only dptorch's backend.

A tracker's ``__torch_function__`` lets Dynamo trace through it (its first line passes the operation
on while Dynamo traces), so a graph holds the model's own operations, and the tracker leaves each
graph to the backend that compiled it. dptorch's backend (``backend="dptorch"``,
``proven_graph.py``) proves every graph with the tracker's own rules and tags its outputs; any other
backend's graph would hand the tracker untagged outputs (samples taken as shared). So:

* while Dynamo traces code a live tracker follows, the graph must be compiled by dptorch's backend
  (checked at trace time: :func:`refuse_other_backends`, run by Dynamo's ``comptime``);
* at run time, an operation a live tracker sees under a compiled call (the eager code between
  graphs) is followed only where the call was compiled by dptorch's backend (:func:`under_other_backend`);
  a graph compiled before a tracker was on torch's mode stack never runs with one on it (Dynamo guards
  the mode stack), so it is traced again, and checked.

Before the tracker let Dynamo trace through it, Dynamo compiled around it into wrong values at batch
size 1 (torch 2.13: GPT-2's MLP block off by 5e-2; ``((o * 2.0) * 3.0 + 5.0).sum()`` gave -14.80 for
7.04), hence the first line.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

from dptorch.grad_sample.errors import PerSampleGradientError

COMPILED_CODE = (
    "torch.compile compiled code that dptorch's batch tracker follows (a model compiled after make_private(..., "
    "wrap_model=False), a compiled loss or step function, or compiled code run while a DP loader's batch is "
    "watched, until the loop is done with it or the controller's cleanup()) with a backend other than dptorch's: its "
    "graphs would hand the tracker outputs it cannot tell apart from shared tensors. Compile with "
    "torch.compile(model, backend=\"dptorch\") (inductor inside, each graph proven by the tracker's rules), or run "
    "the training step uncompiled and compiled evaluation after controller.cleanup()"
)

#: The attribute that marks dptorch's backend (``proven_graph.PrivateBackend``) in Dynamo's chain of wrappers.
MARK = "dptorch_private_backend"
_WRAPPED = ("_torchdynamo_orig_backend", "compiler_fn", "_compiler_fn", "_inner_compiler_fn")


def under_torch_compile() -> bool:
    """Whether this call runs in code that torch.compile (Dynamo) traces or compiled: Dynamo's frame
    callback is set for the whole compiled call, graph breaks included (an untraceable call: it always
    runs eagerly)."""
    return torch.compiler.is_compiling() or torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)


def eager_under_compile(hook: Callable) -> Callable:
    """``hook`` run with Dynamo's frame callback off, as ``torch.compiler.disable`` does (without importing Dynamo):
    under torch.compile the controller's hooks break the graph and run eagerly, as in an eager forward."""
    set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        prior = set_eval_frame(None)
        try:
            return hook(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    run._torchdynamo_disable = True  # Dynamo breaks the graph at the call without tracing into it
    run._torchdynamo_disable_msg = "a hook of dptorch's controller: it runs eagerly"
    if "torch._dynamo" in sys.modules:
        skip_hook_frames(run)
    return run


def skip_hook_frames(hook: Callable) -> None:
    """Have Dynamo run the frames of the hooks' wrapper (one code object, ``hook``'s) without looking into them:
    from the first wrapper made once Dynamo is loaded, or dptorch's backend's first graph."""
    if not _SKIPPED:
        torch._dynamo.eval_frame.skip_code(hook.__code__)
        _SKIPPED.append(hook.__code__)


_SKIPPED: list = []


def is_private_backend(fn: Any) -> bool:
    """Whether ``fn`` (a backend, or one of Dynamo's wrappers of it) is dptorch's backend."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        if getattr(fn, MARK, False):
            return True
        seen.add(id(fn))
        fn = next((getattr(fn, name) for name in _WRAPPED if getattr(fn, name, None) is not None), None)
    return False


def under_other_backend() -> bool:
    """Whether this call runs under a compiled call of a backend other than dptorch's (or while Dynamo traces)."""
    if torch.compiler.is_compiling():
        return True
    callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
    return callback not in (None, False) and not is_private_backend(callback)


def traced(tracker: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """A tracker's operation while Dynamo traces: passed on into the graph, which must be dptorch's backend's
    where the tracker follows operations."""
    if not (tracker.paused or tracker.done):
        torch._dynamo.comptime.comptime(refuse_other_backends)
    return func(*args, **kwargs)


def refuse_other_backends(ctx: Any) -> None:
    """Run by Dynamo's ``comptime`` while it traces an operation a live tracker follows: refused unless the
    graph is dptorch's backend's."""
    output = getattr(ctx, "_ComptimeContext__tx").output
    if not is_private_backend(output.compiler_fn):
        raise CompiledCodeRefused(COMPILED_CODE)


class CompiledCodeRefused(PerSampleGradientError, AssertionError):
    """The refusal raised while Dynamo traces: an ``AssertionError`` too, which Dynamo lets through as it is (a
    ``UserError`` or ``Unsupported`` it would turn into a graph break, and others into its own internal error)."""
