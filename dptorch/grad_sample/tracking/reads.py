"""Parameters read outside their module's call, on their way into a layer call fed no batch.

DeBERTa-v2's encoder reads ``rel_embeddings.weight`` itself (the Embedding module is never called)
and feeds it, without a batch, to a LayerNorm and the attention's position projections. The
weight is then shared by the samples like the output of an origin call (``origins.py``): each
sample's gradient of it is gathered where the tensors derived from it meet the batch, with one
batched vector-Jacobian product, and handed to the controller when autograd's gradient of the
weight arrives. There it must equal the sum of the gathered ones (else some use of the weight was
not seen, and the step is refused).

Only a parameter of a leaf module is followed this way: a module with children may read its own
parameter inside its own call, where its torch.func replay already accounts for that use.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from dptorch.grad_sample.tap import in_own_pass, is_tap_node
from dptorch.grad_sample.tracking.origins import OriginCall, origin_grads

_WALK_LIMIT = 256  # graph nodes looked at from one call's inputs; past it the read goes unseen (and is refused)


def parameters_reached(tensors: Iterable[Tensor], wanted: Callable[[Tensor], bool]) -> List[Tensor]:
    """The ``wanted`` leaf parameters whose values reach ``tensors`` by autograd, not through a tap
    (a captured layer's output, whose own call accounts for what is behind it)."""
    found: Dict[int, Tensor] = {}
    stack = []
    for t in tensors:
        if t.grad_fn is None:
            if t.requires_grad and wanted(t):
                found[id(t)] = t
        else:
            stack.append(t.grad_fn)
    seen = set()
    while stack and len(seen) < _WALK_LIMIT:
        node = stack.pop()
        if node is None or id(node) in seen or is_tap_node(node):
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            if wanted(variable):
                found[id(variable)] = variable
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


class ParameterReads:
    """The parameters of one controller read outside their module's call in the current forward."""

    def __init__(self, owners: Callable[[], Dict[int, List[nn.Module]]], name_of: Callable[[Tensor], str],
                 deliver: Callable[[Tensor, Tensor], None]) -> None:
        self._owners = owners  # id(parameter) -> the hooked modules holding it directly (built once)
        self._owner_map: Optional[Dict[int, List[nn.Module]]] = None
        self._name_of = name_of
        self._deliver = deliver  # deliver(parameter, per-sample gradients (n, *shape)) in backward
        self._pending: Dict[Tensor, Tuple[OriginCall, object]] = {}  # parameter -> (origin, hook handle)
        self._fired: "weakref.WeakSet[OriginCall]" = weakref.WeakSet()
        self.delivered: set = set()  # parameters whose per-sample gradients came from here this round

    def followed(self, param: Tensor, exclude: Iterable[Tensor]) -> bool:
        """Whether a read of ``param`` is followed: a trainable parameter of leaf modules only, not
        among the reading call's own (``exclude``)."""
        if self._owner_map is None:
            self._owner_map = self._owners()
        owners = self._owner_map.get(id(param))
        return (bool(owners) and param.requires_grad and all(next(m.children(), None) is None for m in owners)
                and not any(param is p for p in exclude))

    def origins(self, tensors: Iterable[Tensor], n: int, exclude: Iterable[Tensor], table: Dict) -> Tuple[OriginCall, ...]:
        """The origins standing for the parameters read into a call fed no batch (one per parameter
        and forward: ``table``, the tracker's, holds them)."""
        exclude = tuple(exclude)
        found = []
        for param in parameters_reached(tensors, lambda p: self.followed(p, exclude)):
            origin = table.get(param)
            if origin is None:
                origin = OriginCall(self._name_of(param), n, read=True)
                origin.bind(param)
                table[param] = origin
                self._watch(param, origin)
            found.append(origin)
        return tuple(found)

    def _watch(self, param: Tensor, origin: OriginCall) -> None:
        previous = self._pending.pop(param, None)
        if previous is not None:  # the previous forward's hook (fired, or its backward never ran)
            previous[1].remove()
        handle = param.register_hook(lambda grad: self._arrived(param, origin, grad))
        self._pending[param] = (origin, handle)

    def _arrived(self, param: Tensor, origin: OriginCall, grad: Tensor) -> None:
        entry = self._pending.get(param)
        if in_own_pass() or entry is None or entry[0] is not origin or origin in self._fired:
            return  # a meeting's own vector-Jacobian product, or a stale hook (not removed while autograd runs hooks)
        self._fired.add(origin)
        with torch.no_grad():
            per_sample = origin_grads(origin, grad, rows_ok=False)[0]
        self.delivered.add(param)
        self._deliver(param, per_sample)

    def remove(self) -> None:
        """Remove the hooks (the controller's cleanup)."""
        for _, handle in self._pending.values():
            handle.remove()
        self._pending.clear()
        self.delivered.clear()
