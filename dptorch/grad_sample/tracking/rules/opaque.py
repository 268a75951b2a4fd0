"""Operations whose outputs lose the batch, and the rule for operations without one (fail closed)."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Dict, List, Optional

from torch import Tensor

from dptorch.grad_sample.tracking.args import Tracker, op_name, tensors_of
from dptorch.grad_sample.tracking.writes import derived, written


UNFOLLOWED: Counter = Counter()  # names of operations the tracker has no rule for (diagnostics)


def lost_if_tagged(tr, func, args, kwargs, reason: Optional[str] = None):
    """Every tensor output (and anything written in place) loses the batch if an input derives from it."""
    tags = [tr.get(t) for t in _inputs(args, kwargs)]
    targets = written(func, args, kwargs)
    old = [tr.get(t) for t in targets]
    out = tr.run(func, args, kwargs)
    lost = tr.lost_from(reason or f"{op_name(func)}, which the tracker does not follow", tags) if any(
        derived(g) or type(g) is tuple for g in tags) else None
    tr.put_all(out, lost)
    for t, g in zip(targets, old):
        tr.wrote(t, g, lost)
    return out


def default(tr: Tracker, func, args, kwargs):
    """An operation without a rule fails closed: if any input derives from the batch, every tensor
    output, and every tensor it writes into, is ``Lost`` (a layer fed one is refused, naming the
    operation). Inputs derived only from origin calls give outputs derived from those origins."""
    name = op_name(func)
    UNFOLLOWED[name] += 1
    tags = [tr.get(t) for t in _inputs(args, kwargs)]
    origins = [g for g in tags if type(g) is tuple]
    if not any(derived(g) for g in tags) and origins and not written(func, args, kwargs):
        out = tr.run(func, args, kwargs)
        tr.put_all(out, tuple(dict.fromkeys(x for g in origins for x in g)))
        return out
    return lost_if_tagged(tr, func, args, kwargs, f"{name}, an operation the batch tracker has no rule for")


def _inputs(args: tuple, kwargs: dict) -> List[Tensor]:
    """The tensor arguments, those inside list arguments included (``out=`` is written, not read)."""
    return [t for _, t in tensors_of(args, kwargs)] + [b for a in args if isinstance(a, (list, tuple))
                                                      for b in a if isinstance(b, Tensor)]


RULES: Dict[str, Callable] = {n: lost_if_tagged for n in """masked_select nonzero argwhere unique unique_consecutive
bincount histc as_strided masked_scatter""".split()}
