"""Operations whose outputs lose the batch, and the rule for operations without one."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable, Dict, Optional

from torch import Tensor

from dptorch.grad_sample.tracking.args import op_name, tensors_of
from dptorch.grad_sample.tracking.tags import Lost

if TYPE_CHECKING:
    from dptorch.grad_sample.tracking.mode import BatchTracker

UNFOLLOWED: Counter = Counter()  # names of operations the tracker has no rule for (diagnostics)


def lost_if_tagged(tr, func, args, kwargs, reason: Optional[str] = None):
    tags = [tr.get(t) for _, t in tensors_of(args, kwargs)]
    out = tr.run(func, args, kwargs)
    tr.put_all(out, tr.lost_from(reason or f"{op_name(func)}, which the tracker does not follow", tags))
    return out


def default(tr: BatchTracker, func, args, kwargs):
    """An operation without a rule: outputs shaped exactly like a batched input keep its tag;
    other tensor outputs lose the batch (so a layer fed them is refused, naming the operation)."""
    name = op_name(func)
    UNFOLLOWED[name] += 1
    tensors = [t for _, t in tensors_of(args, kwargs)] + [b for a in args if isinstance(a, (list, tuple)) for b in a if isinstance(b, Tensor)]
    tags = [(t, tr.get(t)) for t in tensors]
    batched = [(t, g) for t, g in tags if type(g) is int]
    origins = [g for _, g in tags if type(g) is tuple]
    if batched and origins and tr.n > 1 and any(t.requires_grad for t, g in tags if type(g) is tuple):
        raise tr.unsupported_meeting(origins[0], f"{name}, an operation the batch tracker does not follow")
    out = tr.run(func, args, kwargs)
    outs = out if isinstance(out, (list, tuple)) else (out,)
    for o in outs:
        if not isinstance(o, Tensor):
            continue
        match = next((g for t, g in batched if t.shape == o.shape), None)
        if match is not None:
            tr.put(o, match)
        elif batched or any(type(g) is Lost for _, g in tags):
            tr.put(o, tr.lost_from(f"{name}, an operation the batch tracker does not follow", [g for _, g in tags]))
        elif origins:
            tr.put(o, tuple(dict.fromkeys(x for g in origins for x in g)))
    return out


RULES: Dict[str, Callable] = {n: lost_if_tagged for n in """masked_select nonzero argwhere unique unique_consecutive
bincount histc as_strided""".split()}
