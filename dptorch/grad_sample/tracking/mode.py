"""The batch tracker: a ``TorchFunctionMode`` that follows the batch dimension through one root forward.

During a capturing root forward, ``BatchTracker`` follows every torch operation. The root call's
batched inputs are tagged with their batch dimension (``tags.py``); an operation's outputs are
tagged from its inputs' tags by the rule the registry (``registry.py``) holds for it
(``rules/``, by family). A layer call is then *per-sample* because its input derives from the
batch, never because a size happens to equal the batch size.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tap import tap
from dptorch.grad_sample.tracking.args import any_tensor, op_name
from dptorch.grad_sample.tracking.compiled import COMPILED_CODE, under_torch_compile
from dptorch.grad_sample.tracking.loss import backward_rule, has_total, read_scaling_rule, scales_after_read, total_rule
from dptorch.grad_sample.tracking.memory import BatchMemory
from dptorch.grad_sample.tracking.origins import OriginCall, meeting_backward
from dptorch.grad_sample.tracking.registry import UNFOLLOWED, rule_of
from dptorch.grad_sample.tracking.rules.escapes import escape
from dptorch.grad_sample.tracking.rules.metadata import count, skip
from dptorch.grad_sample.tracking.tags import (DIM, INNER, MISALIGNED, ORDERED, ROWS_ORDERED, WEAK, Lost, as_strong,
                                               ordered_at, unit_entries)
from dptorch.grad_sample.tracking.unseen import follow as follow_unseen
from dptorch.grad_sample.tracking.unseen import register as register_unseen
from dptorch.grad_sample.tracking.writes import Writes, written

class BatchTracker(TorchFunctionMode):
    """Follows the batch dimension through the torch operations of one root forward.

    ``n`` is the root call's batch size. ``skip`` and ``quiet`` come from the controller: whether
    backward capture is suspended, and a context suspending it (for the vector-Jacobian products
    of meetings).
    """

    follows_batch = True  # what the guard of operations run with torch functions off looks for (unseen.py)

    def __init__(self, n: int, skip: Callable[[], bool], quiet: Callable[[], Any]) -> None:
        super().__init__()
        self.n = n
        self.skip = skip
        self.quiet = quiet
        self.paused = False
        self._table: Dict[int, Tuple[Any, Any]] = {}
        self._origins: List[OriginCall] = []
        self.param_origins: Dict[Tensor, OriginCall] = {}  # parameters read outside their module's call (reads.py)
        self._out: Any = _NOT_RUN
        # the loss (loss.py): the controller's reduction, what backward() tells it, totals formed so far,
        # a total's value read into Python, and whether this tracker's loss phase ended (it then ignores all)
        self.loss_reduction: Optional[str] = None
        self.unit_kind: Callable[[], str] = lambda: "rows"  # or "grouped" rows, or "tokens" (the controller says)
        self.unit_ids: Callable[[], Optional[Tensor]] = lambda: None  # grouped rows: the unit of each row
        self.owner: Callable[[], Any] = lambda: True  # the controller (a weak reference): gone, the tracker idles
        self.on_backward: Callable[[], None] = lambda: None
        self.totals = 0
        self.escaped: Optional[str] = None
        self.counted: Optional[str] = None  # a batch size read into Python outside the forward (rules/metadata.py)
        self.checks_backward = True  # False for the draw's watch (watch.py), which only tags
        self.done = False
        self.forward_done = False  # the root forward returned (escapes are refused only inside it)
        self.nested_forwards = 0  # the model's own forwards run in the loss phase (a reference model's, no gradient)
        self.writes = Writes()  # in-place writes that made aliased memory dirty (writes.py)
        self.memory = BatchMemory()  # the storages that hold batch data (memory.py)
        self.rows: Optional[Tensor] = None  # the rows of a DP loader's draw this forward's batch is, if cut from it
        register_unseen(self)

    def __enter__(self):
        entered = super().__enter__()
        follow_unseen()
        return entered

    # ---------------------------------------------------------------- table

    def get(self, t: Any) -> Any:
        entry = self._table.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        if not isinstance(t, Tensor) or self.writes.fresh(t):
            return None
        if self.writes.dirty:
            tag = self.writes.untagged(t)
            if tag is not None:
                return tag
        return self.memory.tag_of(t, self._own) if self.memory else None

    def _own(self, t: Tensor) -> Any:
        """The tag this table holds for ``t`` itself (no alias is consulted)."""
        entry = self._table.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def wrote(self, target: Tensor, old: Any, new: Any, reason: Optional[str] = None) -> None:
        """An in-place write changed ``target``'s tag from ``old`` to ``new`` (see ``writes.py``)."""
        self.writes.wrote(self, target, old, new, reason)

    def put(self, t: Any, tag: Any) -> None:
        if isinstance(t, Tensor):
            if tag is None:
                entry = self._table.get(id(t))
                if entry is not None and entry[0]() is t:
                    del self._table[id(t)]
            else:
                if type(tag) is Lost and tag.kind in ORDERED:
                    if tag.holder is None:
                        tag.holder = id(t)
                    if tag.holder != id(t) or tag.order is None or tag.dim >= t.dim() or (
                            t.shape[tag.dim] != tag.order.numel()):  # carried as it is by a rule that does not say
                        tag = Lost(tag.reason, weak=tag.weak)  # where the rows went, or not as many rows as it says
                if type(tag) is Lost and self.rows is not None and tag.kind in ROWS_ORDERED:
                    tag = self._as_rows(tag)
                self._table[id(t)] = (weakref.ref(t), tag)
                if self.n > 1:
                    self.memory.note(t, tag)

    def put_all(self, out: Any, tag: Any) -> None:
        if isinstance(out, Tensor):
            self.put(out, tag)
        elif isinstance(out, (list, tuple)):
            for o in out:
                self.put(o, tag)

    def tag_root(self, t: Tensor, dim: int, strong: bool) -> None:
        if self.get(t) is None or strong:
            self.put(t, dim if strong else dim + WEAK)

    def lost(self, reason: str, tag: Any = None) -> Optional[Lost]:
        """A ``Lost`` (None for a batch of at most one sample), weak if ``tag`` (what it came from) is."""
        weak = (type(tag) is int and bool(tag & WEAK)) or (type(tag) is Lost and tag.weak)
        return Lost(reason, weak=weak) if self.n > 1 else None

    def lost_from(self, reason: str, tags: Sequence[Any]) -> Optional[Lost]:
        """A ``Lost`` from several inputs: weak only if every batch-derived one is."""
        derived = [g for g in tags if type(g) is int or type(g) is Lost]
        weak = bool(derived) and all((type(g) is int and g & WEAK) or (type(g) is Lost and g.weak) for g in derived)
        return Lost(reason, weak=weak) if self.n > 1 else None

    # ---------------------------------------------------------------- dispatch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.paused or self.done or (self.forward_done and self.owner() is None):
            return func(*args, **kwargs)
        if under_torch_compile():
            raise PerSampleGradientError(COMPILED_CODE)
        rule = rule_of(func)
        if self.totals and ((self.forward_done and not self.nested_forwards) or rule is not escape) and has_total(self, args, kwargs):
            return total_rule(self, func, args, kwargs)  # inside the forward a total's value is refused like any
        if rule is skip or (rule is count and not self.forward_done):
            return func(*args, **kwargs)
        if self.forward_done and not self.nested_forwards and scales_after_read(self, func, args, kwargs):
            return read_scaling_rule(self, func, args, kwargs)
        if rule is backward_rule:  # even of an untagged root (a batch of one's loss): the loss phase ends there
            return rule(self, func, args, kwargs)
        table = self._table
        for a in args:
            if isinstance(a, Tensor):
                if id(a) in table:
                    break
            elif isinstance(a, (list, tuple)):
                if any(isinstance(b, Tensor) and id(b) in table for b in a):
                    break
        else:
            for a in kwargs.values():
                if isinstance(a, Tensor) and id(a) in table:
                    break
            else:
                if not (self.writes.dirty and self.writes.touches(args, kwargs)) and not (
                        self.memory and any_tensor(args, kwargs, self.memory.holds)):
                    return func(*args, **kwargs)
        self._out = _NOT_RUN
        out_arg = kwargs.get("out")
        try:
            if out_arg is None:
                return rule(self, func, args, kwargs)
            return self._writing(rule, func, args, kwargs, [t for t in (out_arg if isinstance(out_arg, (list, tuple))
                                                                        else (out_arg,)) if isinstance(t, Tensor)])
        except PerSampleGradientError:
            raise
        except Exception as err:
            # The operation itself failed: its error is the user's. Otherwise a rule of ours did: the
            # outputs lose the batch (a layer fed them is refused, naming the operation).
            out = self._out
            if out is _RAISED:
                raise
            if out is _NOT_RUN:
                out = func(*args, **kwargs)
            UNFOLLOWED[f"{op_name(func)} (rule failed: {type(err).__name__})"] += 1
            lost = self.lost(f"{op_name(func)}, which the batch tracker failed to follow ({err!r})")
            self.put_all(out, lost)
            for target in written(func, args, kwargs):
                self.wrote(target, self.get(target), lost)
            return out
        finally:
            self._out = _NOT_RUN

    def _writing(self, rule: Callable, func, args: tuple, kwargs: dict, targets: List[Tensor]) -> Any:
        """An operation writing into ``targets`` (``out=``, or in place): the rule tags the results, then
        each write is checked against the target's aliases."""
        old = [self.get(t) for t in targets]
        result = rule(self, func, args, kwargs)
        for t, g in zip(targets, old):
            self.wrote(t, g, self.get(t))
        return result

    def run(self, func, args: tuple, kwargs: dict) -> Any:
        """Run the operation (rules call it through here, so that its own errors are told apart)."""
        self._out = _RAISED
        out = func(*args, **kwargs)
        self._out = out
        return out

    # ---------------------------------------------------------------- combining

    def combine(self, items: List[Tuple[Any, int, int]], elementwise: bool = False) -> Tuple[Any, List[int]]:
        """The tag of a result from ``(tag, tensor ndim, result ndim)`` of aligned inputs; ``elementwise``: each
        element of the result is made of the inputs' elements at its place (broadcast), so that Losts saying which
        sample each row is (``ORDERED``) may keep saying it; other operations lose them.

        Returns the tag and the indices (into ``items``) of origin-derived inputs, which meet the
        batch when the tag is a batch dim.
        """
        strong: List[int] = []
        weak: List[int] = []
        lost = None  # the first strong Lost, else the first weak one
        ordered: List[Tuple[Lost, bool]] = []  # Losts that say which sample each row is, and whether unbroadcast
        origins: List[int] = []
        for i, (tag, ndim, out_ndim) in enumerate(items):
            if tag is None:
                continue
            if type(tag) is int:  # the aligned dim, with the merged factor (0 if none)
                d = (tag & DIM) + out_ndim - ndim + (tag & ~(DIM | WEAK))
                (weak if tag & WEAK else strong).append(d)
            elif type(tag) is Lost:
                if lost is None or (lost.weak and not tag.weak):
                    lost = tag
                if tag.kind in ORDERED:
                    ordered.append((tag, ndim == out_ndim))
            else:
                origins.append(i)
        if ordered and not elementwise:
            lost = Lost(ordered[0][0].reason, weak=ordered[0][0].weak)
        elif ordered and not _same_rows(ordered, strong or weak, items):
            units = self._unit_entries(items) if self.n > 1 and self.unit_kind() == "grouped" else None
            if units is not None:  # rows of one privacy unit each (set_privacy_units) meeting: still its own
                return units, []
            # rows of the batch in another order (or a part of them) meeting other rows: sample i's row and
            # another sample's are aligned, whatever indexing later puts them back in order
            lost = Lost(f"{ordered[0][0].reason}, aligned with rows of other samples")
        if self.n <= 1:
            lost = None
        if ordered and elementwise and lost is ordered[0][0] and not (strong or weak):  # the same rows, same place
            lost = ordered_at(lost, lost.dim)
        if strong:
            if any(d != strong[0] for d in strong) and self.n > 1:
                return Lost("an operation that aligns the batch of one input with another dimension of another"), []
            if lost is not None:  # a weak one too: the argument's rows may be the samples', mixed
                return as_strong(lost), []
            if any(d != strong[0] for d in weak) and self.n > 1:
                return Lost(MISALIGNED), []
            return strong[0], origins
        if weak:
            if any(d != weak[0] for d in weak) and self.n > 1:
                return Lost("an operation that aligns the batch of one input with another dimension of another",
                            weak=True), []
            if lost is not None:
                return lost, []
            return weak[0] + WEAK, origins
        if lost is not None:
            return lost, []
        if origins:
            return tuple(dict.fromkeys(o for i in origins for o in items[i][0])), []
        return None, []

    def _unit_entries(self, items: List[Tuple[Any, int, int]]) -> Optional[Lost]:
        """Grouped privacy units: an elementwise result whose every batch-derived input holds, along the same
        dim, entries of the same units in the same order (DPO's chosen rows minus the rejected rows of the same
        pairs) holds each unit's own entries there; None if some input does not."""
        unit_ids = self.unit_ids()
        if unit_ids is None or unit_ids.numel() != self.n:
            return None
        found = None
        for tag, ndim, out_ndim in items:
            if tag is None:
                continue
            if type(tag) is int and not tag & ~(DIM | WEAK) and not tag & WEAK:
                dim, order = (tag & DIM) + out_ndim - ndim, unit_ids
            elif type(tag) is Lost and tag.kind in ORDERED and tag.order is not None and ndim == out_ndim:
                dim, order = tag.dim, tag.order if tag.kind == "units" else unit_ids[tag.order]
            else:
                return None
            if found is None:
                found = (dim, order)
            elif found[0] != dim or not torch.equal(found[1], order):
                return None
        return None if found is None else unit_entries(found[1], found[0])

    def meet(self, use: Tensor, out_ndim: int, out_dim: int, broadcasts: bool = True) -> Tensor:
        """``use`` (origin-derived) meets batched tensors in a result batched along ``out_dim``:
        the tensor to compute with instead, behind a tap that keeps each sample's gradient apart.
        ``broadcasts``: whether the operation broadcasts ``use`` (a size-1 dim) against the batch."""
        origins = self.get(use)
        if not use.requires_grad or type(origins) is not tuple:
            return use
        # a batch merged with an inner dim of ``group`` rows (Swin's windows, DeBERTa's heads): the
        # result's dim holds each sample's ``group`` rows one after the other
        group, out_dim = max(out_dim // INNER, 1), out_dim & DIM
        lead = out_ndim - use.ndim
        aligned = out_dim - lead
        if lead < 0:
            raise self.unsupported_meeting(origins, "a batched tensor of lower rank")
        view = use[(None,) * lead] if lead else use
        if broadcasts and (aligned < 0 or use.shape[aligned] == 1):
            broadcast = True
            view = view.expand(*[self.n * group if i == out_dim else -1 for i in range(out_ndim)])
        elif aligned >= 0 and use.shape[aligned] == self.n * group:
            broadcast = False
        else:
            return use  # the operation itself reports the shape mismatch
        direct = tuple(o for o in origins if o.output() is use)
        chained = tuple(o for o in origins if o.output() is not use)
        edges = tuple(o.edge for o in chained)
        on_backward = partial(meeting_backward, use if chained else None, tuple(use.shape), direct, chained, edges,
                              broadcast, out_dim, group, lead, self.n, self.skip, self.quiet)
        return tap((view,), (), on_backward)[0]

    def add_origin(self, origin: OriginCall) -> None:
        self._origins.append(origin)

    def end_forward(self) -> None:
        """End of the root forward: origins drop the graph edge they held for the meetings, and the
        tensors derived only from them are shared again (their uses past the forward are checked
        against the layer's total gradient); batch tags stay, for the loss."""
        self._release_origins()
        for key, (ref, tag) in list(self._table.items()):
            if type(tag) is tuple or ref() is None:
                del self._table[key]

    def _release_origins(self) -> None:
        self.forward_done = True
        for origin in self._origins:
            origin.edge = None
        self._origins.clear()

    def adopt(self, other: "BatchTracker") -> None:
        """Continue ``other``'s loss phase (a second forward before backward), or what the draw's watch
        learnt (``watch.py``), in this root forward."""
        other.end_forward()
        self._table.update(other._table)
        self.memory.take(other.memory)
        self.totals += other.totals
        self.escaped = self.escaped or other.escaped
        self.counted = self.counted or other.counted

    def take_rows(self, rows: Tensor, drawn: int) -> None:
        """This forward's batch is ``rows`` of a draw (a micro-batch cut from it): what holds exactly those
        rows, in that order (its labels, cut the same way, before the forward or after), is batched; what
        holds the whole draw of ``drawn`` rows is not (its rows are other samples')."""
        self.rows = rows
        whole = None if rows.numel() == drawn and torch.equal(rows, torch.arange(drawn)) else torch.arange(drawn)
        for key, (ref, tag) in list(self._table.items()):
            if type(tag) is Lost and tag.kind in ROWS_ORDERED:
                self._table[key] = (ref, self._as_rows(tag))
            elif type(tag) is int and whole is not None:  # the whole draw, in its order, beside part of it
                self._table[key] = (ref, Lost("the whole draw, beside a micro-batch cut from it", "rows", tag & DIM,
                                              whole) if not tag & ~(DIM | WEAK) else Lost("the whole draw"))

    def _as_rows(self, tag: Lost) -> Any:
        rows = self.rows
        same = tag.order is not None and tag.order.shape == rows.shape and torch.equal(tag.order, rows)
        return tag.dim if same else tag

    def close(self) -> None:
        """The end of this tracker: nothing is followed any more."""
        self._release_origins()
        self._table.clear()
        self.writes.clear()
        self.memory.clear()
        self.done = True

    def unsupported_meeting(self, origins: Any, where: str) -> PerSampleGradientError:
        names = ", ".join(dict.fromkeys(o.name for o in origins))
        return PerSampleGradientError(
            f"the output of {names}, a layer called on inputs that carry no batch dimension, meets the batch in "
            f"{where}, where its per-sample gradients cannot be kept apart. Give the layer inputs with a leading "
            "batch dimension (e.g. positions[None].expand(batch_size, -1) instead of positions), or freeze its "
            "parameters."
        )


def _same_rows(ordered: List[Tuple[Lost, bool]], batched: List[int], items: List[Tuple[Any, int, int]]) -> bool:
    """Whether Losts that say which sample each row is (``ORDERED``) may keep saying it in a result: they
    are its only batch-derived inputs, none broadcast, all of one kind and dim, their rows the same samples."""
    first = ordered[0][0]
    losts = sum(1 for tag, _, _ in items if type(tag) is Lost)
    return (not batched and losts == len(ordered) and all(flat for _, flat in ordered)
            and all(t.kind == first.kind and t.dim == first.dim and t.order is not None and first.order is not None
                    and torch.equal(t.order, first.order) for t, _ in ordered))


_NOT_RUN: Any = object()
_RAISED: Any = object()
