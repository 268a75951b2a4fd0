"""What a captured step's trace proves about a tensor's values without reading them.

The tracker's rules read a few index tensors' values: whether ``x[idx, ...]`` indexes the batch
dim with ``arange(n)`` (HF's padding masks: ``padding_mask[batch_arange[:, None, None, None], kv]``),
so that row ``i`` of the result is sample ``i``'s. A captured step (``optim/captured_step.py``) traces
on fake tensors, which have no values; there the evidence is how the trace made the index: an
``aten.arange`` of ``n`` (start 0, step 1), then only views of it, and no write to that memory since
(its version counter, shared by every view, still 0; no in-place operation in the trace's graph on
the arange or any view of it, which also covers a ``.data`` alias, whose counter is its own). Anything
else is unproven, and the rule goes the conservative way (the batch is lost, a layer fed it refused).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

_aten = torch.ops.aten
#: Operations whose output is a view of their first argument, keeping its values (``slice`` checked whole).
_VIEWS = {_aten.unsqueeze.default, _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
          _aten.alias.default, _aten.detach.default, _aten.squeeze.dim, _aten.squeeze.default, _aten.slice.Tensor}
_ARANGES = {_aten.arange.default, _aten.arange.start, _aten.arange.start_step}


def is_arange(index: torch.Tensor, n: int) -> bool:
    """Whether ``index`` (flattened) holds ``0, 1, ..., n - 1``: by value, or in a trace by how it was made."""
    if index.numel() != n:
        return False
    if not isinstance(index, FakeTensor):
        return torch.equal(index.reshape(-1).to("cpu"), torch.arange(n))
    return _traced_arange(index) == n


def _traced_arange(index: torch.Tensor) -> Optional[int]:
    """The ``n`` of the ``arange(n)`` the trace made ``index`` from by views alone, unwritten since; else None."""
    mode = get_proxy_mode()
    slot = get_proxy_slot(index, mode.tracer, None) if mode is not None else None
    if slot is None or index._version != 0 or index.dtype in (torch.bool, torch.uint8) or index.is_floating_point():
        return None
    node = slot.proxy.node
    while node.target in _VIEWS:
        if node.target is _aten.slice.Tensor and not _whole_slice(node):
            return None
        node = node.args[0]
    if node.target not in _ARANGES or _written(node):
        return None
    start, end, step = _range_of(node.args)
    return end if (start, step) == (0, 1) and isinstance(end, int) else None


def _range_of(args: tuple) -> tuple:
    if len(args) == 1:
        return 0, args[0], 1
    return (args[0], args[1], args[2] if len(args) > 2 else 1)


def _whole_slice(node) -> bool:
    """``aten.slice(x, dim, start, end, step)`` keeping every element (``x[:]``, ``x[:, None]``'s first part)."""
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = args[1] or 0, args[2], args[3], args[4]
    source = getattr(args[0], "meta", {}).get("val")
    size = source.shape[dim] if isinstance(source, torch.Tensor) else 2**62
    return start in (None, 0) and step in (None, 1) and (end is None or (isinstance(end, int) and end >= size))


def _written(node) -> bool:
    """Whether the trace's graph holds an in-place (or ``out=``) operation on ``node``'s tensor or a view of it."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            schema = getattr(user.target, "_schema", None)
            if schema is None or schema.is_mutable:
                return True  # a mutation, or a call the graph cannot say (a Python function): unproven
            if user.target in _VIEWS:
                stack.append(user)
    return False
