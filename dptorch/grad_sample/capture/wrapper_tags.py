"""Batch tags across sharding wrappers' hooks: FSDP2's forward pre-hook and torch's tensor-parallel styles
replace a module's inputs (and outputs) by tensors the batch tracker never saw being made; the hooks here
note each tensor's tag before the wrapper's hook and hand it to the replacement after."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dptorch.distributed.tensor_parallel import local_shape
from dptorch.grad_sample.capture.attachment import HookTarget
from dptorch.grad_sample.capture.session import RootForward
from dptorch.grad_sample.tracking import Lost
from dptorch.grad_sample.tracking.tags import DIM


class WrapperTags(HookTarget):
    """The tags noted before a wrapper's hook, by module, until its replacements are tagged."""

    def __init__(self, session: RootForward) -> None:
        self._session = session
        self._inputs: Dict[nn.Module, List[Any]] = {}  # FSDP2 modules: inputs (and tags) before its pre-hook
        self._outputs: Dict[nn.Module, Any] = {}  # tensor-parallel layers: the output tapped, before their hook

    def note_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tracker = self._session.tracker
        if tracker is None:
            return
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self._inputs.setdefault(module, []).append([(t, tracker.get(t)) for t in leaves])

    def tag_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        pending = self._inputs.get(module)
        noted = pending.pop() if pending else None
        tracker = self._session.tracker
        if noted is None or tracker is None:
            return
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if len(leaves) != len(noted):
            return
        for t, (before, tag) in zip(leaves, noted):
            if t is not before and tag is not None and tracker.get(t) is None and _keeps_batch_dim(before, t, tag):
                tracker.put(t, tag)

    def note_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._session.tracker is not None:
            self._outputs[module] = output

    def tag_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        """A tensor-parallel layer's output hook redistributes (and unwraps) the output the controller tapped
        (a row-wise layer's partial sums scattered over the tokens): the batch tag passes to the result."""
        before = self._outputs.pop(module, None)
        if before is None or before is output or not isinstance(output, torch.Tensor):
            return
        for tracker in (self._session.tracker, self._session.token_tracker):
            tag = None if tracker is None else tracker.get(before)
            if tag is not None and tracker.get(output) is None and _keeps_batch_dim(before, output, tag):
                tracker.put(output, tag)


def _keeps_batch_dim(before: torch.Tensor, after: torch.Tensor, tag: Any) -> bool:
    """Whether ``after``, what a tensor-parallel hook made of ``before`` (wrapped in a DTensor, gathered or
    scattered along the tokens or features, unwrapped), keeps ``before``'s batch tag: a batch dim (an int
    tag) whole in both, of one size; a lost batch always; an origin's output only at the very same shape."""
    if type(tag) is Lost:
        return True
    if type(tag) is not int:
        return local_shape(after) == local_shape(before)
    dim = tag & DIM
    if before.dim() != after.dim() or dim >= before.dim():
        return False
    return len({before.shape[dim], local_shape(before)[dim], after.shape[dim], local_shape(after)[dim]}) == 1
