"""dptorch's torch.compile backend: each captured graph proven by the batch tracker's own rules.

``torch.compile(model, backend="dptorch")`` (an entry point of this package; ``PrivateBackend(inner)``
for another inner backend than inductor) compiles each graph Dynamo captures with the inner backend
and returns a :class:`ProvenGraph`. Where no batch tracker follows the call (evaluation, a model
without a controller) that runs the compiled graph as it is. Where trackers follow it, what the
graph does to the batch is proven by the eager tracker itself, run once on the graph's own code:

* the proof: ``gm.forward`` run eagerly under the live trackers (Dynamo off), so every operation of
  the graph meets the same rules as in an eager forward, with the same refusals naming the
  operation; its outputs are the step's (exact eager values);
* what is kept: the trackers' tags of the graph's outputs, for the signature of the call: for each
  tracker its batch size, phase and units, and for each input its tag, shape, strides, dtype and
  whether it requires grad (sizes passed as numbers too). While the signature holds and Dynamo's
  guards hold (they say the same graph runs), the compiled graph runs with the trackers paused and
  its outputs get the proven tags;
* what is never kept: a proof at a batch of one (nothing can meet there, so it proves nothing for
  larger ones), one whose inputs carry rows, origins or totals (tags that name tensors or calls of
  one step), one that changed anything of a tracker beyond output tags (an origin, a parameter read
  outside its layer, a loss total, a write), and any graph that writes in place. Those calls are
  proven again each time (eager speed, exact).

Each new batch size is one eager call (Poisson batches: one per size met), then compiled speed.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, fx

from dptorch.grad_sample.tracking.compiled import MARK, eager_under_compile, skip_hook_frames
from dptorch.grad_sample.tracking.tags import Lost


class PrivateBackend:
    """A torch.compile backend: ``inner`` (a backend name or function) compiles, :class:`ProvenGraph` proves."""

    def __init__(self, inner: Union[str, Callable] = "inductor") -> None:
        self.inner = inner
        setattr(self, MARK, True)

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> "ProvenGraph":
        from torch._dynamo.backends.registry import lookup_backend  # start-up time: Dynamo only when compiling

        skip_hook_frames(eager_under_compile(print))
        return ProvenGraph(gm, lookup_backend(self.inner)(gm, example_inputs))

    def __repr__(self) -> str:
        return f"PrivateBackend(inner={self.inner!r})"


#: ``backend="dptorch"``: the entry point Dynamo finds (group ``torch_dynamo_backends`` in pyproject.toml).
dptorch_backend = PrivateBackend()


class ProvenGraph:
    """A compiled graph and the tags its outputs were proven to have, by call signature."""

    def __init__(self, gm: fx.GraphModule, compiled: Callable) -> None:
        self.gm = gm
        self.compiled = compiled
        self.writes = any(_writes_in_place(node) for node in gm.graph.nodes)
        self.proven: Dict[Tuple, List[List[Any]]] = {}
        self.proofs = 0  # eager runs under the trackers (tests count them)

    def __call__(self, *args: Any) -> Any:
        trackers = following_trackers()
        if not trackers:
            return self.compiled(*args)
        key = None if self.writes else signature(trackers, args)
        tags = self.proven.get(key) if key is not None else None
        if tags is None:
            return self._prove(trackers, args, key)
        for tracker in trackers:
            tracker.paused = True
        try:
            out = self.compiled(*args)
        finally:
            for tracker in trackers:
                tracker.paused = False
        outputs = _outputs(out)
        for tracker, tracker_tags in zip(trackers, tags):
            for t, tag in zip(outputs, tracker_tags):
                if tag is not None and isinstance(t, Tensor):
                    tracker.put(t, Lost(tag.reason, weak=tag.weak) if type(tag) is Lost else tag)
        return out

    def _prove(self, trackers: List[Any], args: tuple, key: Optional[Tuple]) -> Any:
        before = [_state(t) for t in trackers]
        out = _run_eagerly(self.gm, args)
        self.proofs += 1
        outputs = _outputs(out)
        tags = [[t.get(o) if isinstance(o, Tensor) else None for o in outputs] for t in trackers]
        if key is not None and [_state(t) for t in trackers] == before and all(
                _replayable(tag) for tracker_tags in tags for tag in tracker_tags):
            self.proven[key] = tags
        return out


def following_trackers() -> List[Any]:
    """The batch trackers on torch's function-mode stack that follow operations now (not paused or done)."""
    modes = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    return [m for m in modes if getattr(m, "follows_batch", False) and not m.paused and not m.done]


def signature(trackers: List[Any], args: tuple) -> Optional[Tuple]:
    """What a proof of a call depends on, or None where it is not to be kept (see the module's docstring)."""
    parts: List[Any] = []
    for tracker in trackers:
        if tracker.n < 2 or tracker.rows is not None or tracker.unit_kind() != "rows" or tracker.writes.dirty:
            return None
        parts.append((type(tracker), tracker.n, tracker.forward_done, tracker.nested_forwards, tracker.loss_reduction,
                      tracker.checks_backward))
        for a in args:
            if isinstance(a, Tensor):
                tag = tracker.get(a)
                if not _replayable(tag):
                    return None
                kept = (tag.reason, tag.weak) if type(tag) is Lost else tag
                parts.append((kept, tuple(a.shape), a.stride(), a.dtype, a.requires_grad, a.device))
            elif isinstance(a, (int, float, bool)) or a is None:
                parts.append(a)
            else:
                return None
    return tuple(parts)


def _replayable(tag: Any) -> bool:
    """A tag that says nothing of one step's tensors or calls: none, a batch dim, or a plainly lost batch."""
    if tag is None or type(tag) is int:
        return True
    return (type(tag) is Lost and tag.kind is None and tag.order is None and not tag.units and not tag.scaled_inside
            and tag.count is None)


def _state(tracker: Any) -> Tuple:
    """What a tracker holds beyond tags: a proof that changes it is not kept."""
    return (len(tracker._origins), len(tracker.param_origins), tracker.totals, tracker.escaped, tracker.counted,
            tracker.nested_forwards, tracker.done, len(tracker.writes.dirty), len(tracker.writes.rewritten))


def _outputs(out: Any) -> Tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _writes_in_place(node: fx.Node) -> bool:
    """Whether a Dynamo graph node writes into a tensor (an in-place method or function, ``out=``, ``inplace=True``,
    item assignment)."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.kwargs.get("out") is not None or node.kwargs.get("inplace") is True:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in ("setitem", "__setitem__", "iadd", "isub",
                                                                         "imul", "itruediv")


def _run_eagerly(gm: fx.GraphModule, args: tuple) -> Any:
    """The graph's own code, run eagerly with Dynamo off (the trackers see each operation)."""
    return torch.compiler.disable(gm.forward)(*args)


__all__ = ["PrivateBackend", "ProvenGraph", "dptorch_backend", "following_trackers", "signature"]
