"""Batch tracking: which tensors of a forward carry the batch, and along which dimension.

During a capturing root forward, ``BatchTracker`` (a ``TorchFunctionMode``) follows every torch
operation. The root call's batched inputs are tagged with their batch dimension; an operation's
outputs are tagged from its inputs' tags (transpositions, views, broadcasting, reductions,
contractions, indexing, ...). A layer call is then *per-sample* because its input derives from
the batch, never because a size happens to equal the batch size.

Tags (kept in a side table keyed by tensor identity, holding weak references only):

- an ``int``: batched along that dim; ``+ WEAK`` when the evidence is only a root argument whose
  size matched the batch (a mask ``(T, T)`` with ``T == n``): a weak dim gives way to a strong one;
  ``+ k * INNER`` when the batch was merged with an inner dim of size ``k`` (BLOOM's ``(B * H, T, d)``,
  OPT's ``(B * T, d)``): the dim holds each sample's ``k`` rows one after the other;
- a ``Lost``: derived from the batch, but the batch dim is gone (a mean over the batch, the batch
  interleaved with another dim, an operation the tracker does not follow). A layer fed such a
  tensor is refused: its per-sample gradients are not defined;
- a tuple of ``OriginCall``: derived only from the output of a captured layer call whose inputs
  carry no batch (T5's relative attention bias of bucket ids ``(T, T)``, nanoGPT's
  ``wpe(arange(T))``). Where such a tensor meets batched tensors (broadcast in ``scores + bias``,
  ``tok + pos``, an ``attn_mask``), it is replaced by its expansion along the batch dim behind an
  identity tap, so that each sample's gradient of it is kept apart in backward and mapped back to
  the layer's output (through the operations in between, with one batched vector-Jacobian
  product). Each layer call then gets exact per-sample gradients, whatever ``T`` and ``n``.

Untagged tensors (parameters, buffers, ``arange``, factories) are shared by all samples.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tap import tap

WEAK = 64  # added to a dim when the batch was only inferred from a root argument's size
_DIM = WEAK - 1
_KEEP = ~_DIM  # all but the dim: strength and the merged factor
INNER = 128  # the batch dim holds n groups of ``tag // INNER`` rows (the batch merged with a dim inside it)
UNFOLLOWED: Counter = Counter()  # names of operations the tracker has no rule for (diagnostics)


class Lost:
    """A batch-derived tensor whose batch dimension is gone; ``reason`` says where.

    Two kinds are followed further: "packed" (a PackedSequence's data; ``order`` its
    ``sorted_indices`` or None) and "permuted" (the batch along ``dim``, but row ``i`` is sample
    ``order[i]``); gathering the rows back into the batch's order makes them batched again. A
    ``weak`` one was derived from weak evidence only, and gives way to a strong batch dim.
    """

    __slots__ = ("reason", "kind", "dim", "order", "weak")

    def __init__(self, reason: str, kind: Optional[str] = None, dim: int = 0, order: Optional[Tensor] = None,
                 weak: bool = False) -> None:
        self.reason = reason
        self.kind = kind
        self.dim = dim
        self.order = order
        self.weak = weak  # derived only from weak evidence: gives way to a strong batch dim

    def __repr__(self) -> str:
        return f"Lost({self.reason!r})"


_PACKED_REASON = "the data of a PackedSequence (the rows of all samples interleaved by time step)"
PACKED = Lost(_PACKED_REASON, "packed")


def packed(order: Optional[Tensor]) -> Lost:
    """The tag of a PackedSequence's data whose sequences are in ``order`` (its sorted_indices)."""
    return PACKED if order is None else Lost(_PACKED_REASON, "packed", 0, order)


class OriginCall:
    """A captured layer call whose inputs carry no batch dimension.

    Its output is shared by the samples; the per-sample gradients of that output are gathered
    where it (or a tensor derived only from it) meets batched tensors: ``dense`` holds
    ``(n, *output.shape)`` gradients; ``rows`` holds ``(grad, dim)`` pairs of a use whose
    ``dim`` pairs row ``i`` with sample ``i`` (the output already had ``n`` rows there).
    """

    __slots__ = ("name", "n", "shape", "output", "edge", "dense", "rows", "__weakref__")

    def __init__(self, name: str, n: int) -> None:
        self.name = name
        self.n = n
        self.shape: Tuple[int, ...] = ()
        self.output: Callable[[], Optional[Tensor]] = lambda: None
        self.edge: Any = None
        self.dense: Optional[Tensor] = None
        self.rows: List[Tuple[Tensor, int]] = []

    def bind(self, output: Tensor, tracked: bool = True) -> None:
        """The layer's (tapped) output, whose per-sample gradients this call collects; ``tracked``:
        whether meetings may follow (then the graph edge is held until the forward ends)."""
        self.shape = tuple(output.shape)
        self.output = weakref.ref(output)
        self.edge = get_gradient_edge(output) if tracked else None

    def add_dense(self, grads: Tensor) -> None:
        self.dense = grads if self.dense is None else self.dense + grads

    def take(self) -> Tuple[Optional[Tensor], List[Tuple[Tensor, int]]]:
        dense, rows = self.dense, self.rows
        self.dense, self.rows = None, []
        return dense, rows


def rows_to_dense(rows: Tensor, dim: int, n: int) -> Tensor:
    """``(n, *rows.shape)`` where sample ``i`` keeps only row ``i`` (along ``dim``) of ``rows``."""
    dense = rows.new_zeros((n, *rows.shape))
    index = torch.arange(n, device=rows.device)
    dense.movedim(dim + 1, 1)[index, index] = rows.movedim(dim, 0)
    return dense


def _meeting_backward(use: Optional[Tensor], shape: Tuple[int, ...], direct: Tuple[OriginCall, ...],
                      chained: Tuple[OriginCall, ...], edges: tuple, broadcast: bool, out_dim: int, lead: int, n: int,
                      skip: Callable[[], bool], quiet: Callable[[], Any],
                      saved: Tuple[Tensor, ...], grads: Tuple[Tensor, ...]) -> None:
    """Per-sample gradients of an origin-derived tensor (``use``, of ``shape``) where it met the batch."""
    grad = grads[0]
    if grad is None or skip():
        return
    if broadcast:  # the use was expanded along out_dim: row i of grad is sample i's
        per_sample = grad.movedim(out_dim, 0).reshape(n, *shape)
        for origin in direct:
            origin.add_dense(per_sample)
    else:  # the use already had n rows along out_dim, paired with the samples
        rows, dim = grad.reshape(shape), out_dim - lead
        for origin in direct:
            origin.rows.append((rows, dim))
        per_sample = rows_to_dense(rows, dim, n) if chained else None
    if chained:  # through the operations between each origin's output and this use
        with quiet():
            found = torch.autograd.grad([use], list(edges), [per_sample], retain_graph=True, allow_unused=True,
                                        is_grads_batched=True)
        for origin, g in zip(chained, found):
            if g is not None:
                origin.add_dense(g)


@dataclass
class CallBatch:
    """How one layer call carries the batch.

    ``kind``: "batched" (tensor argument ``i`` along ``input_dims[i]``, output ``j`` along
    ``output_dims[j]``; None: not batched), "origin" (no argument carries the batch; ``origins``,
    one per output, collect its per-sample output gradients) or "single" (a batch of at most one
    sample: the whole call is that sample's).
    """

    kind: str
    n: int
    input_dims: Tuple[Optional[int], ...] = ()
    output_dims: Tuple[Optional[int], ...] = ()
    origins: Tuple[OriginCall, ...] = ()


def classify(tags: Sequence[Any], n: int) -> Tuple[str, Tuple[Optional[int], ...], Any]:
    """``(kind, input dims, primary tag)`` of a layer call whose tensor arguments have ``tags``
    (a dim is ``d + k * INNER`` when the batch is merged with an inner dim of size ``k``).

    kind is "batched", "origin", "single" or "lost" (the primary tag is then the ``Lost``): a
    batch-derived argument without its batch dim, or mixed with batched ones, has no per-sample
    gradient. Weak dims count only where no strong one exists, or where they agree with it.
    """
    strong = [g for g in tags if type(g) is int and not g & WEAK]
    weak = [g for g in tags if type(g) is int and g & WEAK]
    losts = [g for g in tags if type(g) is Lost]
    lost = next((g for g in losts if not g.weak), losts[0] if losts else None)
    if strong or weak:
        primary = (strong or weak)[0]
        if lost is not None and n > 1 and (not lost.weak or not strong):
            return "lost", (), lost
        dims = []
        for g in tags:
            if type(g) is int and (not strong or not g & WEAK or g & ~WEAK == primary & ~WEAK):
                dims.append(g & ~WEAK)
            else:
                dims.append(None)
        return "batched", tuple(dims), primary
    if n <= 1:
        return "single", (None,) * len(tags), None
    if lost is not None:
        return "lost", (), lost
    return "origin", (None,) * len(tags), None


def origin_grads(origin: OriginCall, total: Tensor, rows_ok: bool) -> Tuple[Tensor, Optional[int]]:
    """Per-sample gradients of an origin call's output, from its meetings with the batch.

    ``(grads, None)`` with ``grads`` of shape ``(n, *output.shape)``; or, when ``rows_ok`` and every
    use paired the output's rows along one ``dim`` with the samples, ``(rows, dim)``. Refuses them
    unless they add up to the output's gradient ``total``: some use was not seen.
    """
    dense, rows = origin.take()
    if dense is None and rows and rows_ok and all(dim == rows[0][1] for _, dim in rows):
        summed = rows[0][0]
        for r, _ in rows[1:]:
            summed = summed + r
        _check_total(origin, summed, total)
        return summed, rows[0][1]
    if dense is None:
        dense = total.new_zeros((origin.n, *total.shape))
    for r, dim in rows:
        dense = dense + rows_to_dense(r, dim, origin.n)
    _check_total(origin, dense.sum(0), total)
    return dense, None


def _check_total(origin: OriginCall, got: Tensor, total: Tensor) -> None:
    if not total.is_floating_point() or not bool(torch.isfinite(total).all()):
        return
    scale = float(total.abs().max()) if total.numel() else 0.0
    tol = (1e-3 if total.dtype in (torch.float32, torch.float64) else 2e-2) * scale + 1e-7
    if total.numel() and float((got.to(total.dtype) - total).abs().max()) > tol:
        raise PerSampleGradientError(
            f"{origin.name} is called on inputs that carry no batch dimension (its output is shared by the samples), "
            "and part of its output's gradient reached it by a path where the samples could not be told apart (the "
            "output, or a tensor derived from it, met the batch outside the model's forward, in reentrant activation "
            "checkpointing, or through an operation the batch tracker does not follow). Give the layer inputs with a "
            "leading batch dimension (e.g. positions[None].expand(batch_size, -1)), or freeze its parameters."
        )


# ---------------------------------------------------------------------------------------------- helpers


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _dims_arg(value: Any, ndim: int) -> Optional[Tuple[int, ...]]:
    """A ``dim`` argument as normalised dims; None means all dims."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(_norm_dim(int(v), max(ndim, 1)) for v in value) if len(value) else None
    return (_norm_dim(int(value), max(ndim, 1)),)


def _shape_args(args: tuple, start: int) -> Tuple[int, ...]:
    rest = args[start:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        return tuple(rest[0])
    return tuple(rest)


def _regroup(in_shape: Sequence[int], out_shape: Sequence[int], d: int, inner: int, n: int) -> Optional[Tuple[int, int]]:
    """Where the batch of a row-major reshape lands: ``(dim, inner)``, or None if it is split or
    interleaved. In ``in_shape`` the batch is dim ``d`` (``n`` groups of ``inner`` rows, 1 if not
    merged); in the result it is a dim of ``n * inner'`` rows with the same elements before it."""
    if 0 in in_shape or n < 1:
        new = _reshape_dim(in_shape, out_shape, d) if inner <= 1 else None
        return None if new is None else (new, 1)
    before = math.prod(in_shape[:d])
    after = inner * math.prod(in_shape[d + 1 :])  # elements of one sample's group
    acc = 1
    for e, s in enumerate(out_shape):
        if acc == before and s >= n and s % n == 0 and (s // n) * math.prod(out_shape[e + 1 :]) == after:
            return e, s // n
        acc *= s
        if acc > before:
            return None
    return None


def _reshape_dim(in_shape: Sequence[int], out_shape: Sequence[int], d: int) -> Optional[int]:
    """Where dim ``d`` of a row-major reshape lands, if it stays a dim of its own."""
    size = in_shape[d]
    if 0 in in_shape:
        return d if d < len(out_shape) and out_shape[d] == size else None
    before = math.prod(in_shape[:d])
    acc = 1
    for e, s in enumerate(out_shape):
        if acc == before and s == size:
            return e
        acc *= s
        if acc > before:
            return None
    return None


# ---------------------------------------------------------------------------------------------- the mode


class BatchTracker(TorchFunctionMode):
    """Follows the batch dimension through the torch operations of one root forward.

    ``n`` is the root call's batch size. ``skip`` and ``quiet`` come from the controller: whether
    backward capture is suspended, and a context suspending it (for the vector-Jacobian products
    of meetings).
    """

    def __init__(self, n: int, skip: Callable[[], bool], quiet: Callable[[], Any]) -> None:
        super().__init__()
        self.n = n
        self.skip = skip
        self.quiet = quiet
        self.paused = False
        self._table: Dict[int, Tuple[Any, Any]] = {}
        self._origins: List[OriginCall] = []
        self._out: Any = _NOT_RUN

    # ---------------------------------------------------------------- table

    def get(self, t: Any) -> Any:
        entry = self._table.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def put(self, t: Any, tag: Any) -> None:
        if isinstance(t, Tensor):
            if tag is None:
                entry = self._table.get(id(t))
                if entry is not None and entry[0]() is t:
                    del self._table[id(t)]
            else:
                self._table[id(t)] = (weakref.ref(t), tag)

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
        if self.paused:
            return func(*args, **kwargs)
        rule = _CACHE.get(func)
        if rule is None:
            rule = _rule_for(func)
            try:
                _CACHE[func] = rule
            except TypeError:
                pass
        if rule is _skip:
            return func(*args, **kwargs)
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
                return func(*args, **kwargs)
        self._out = _NOT_RUN
        try:
            return rule(self, func, args, kwargs)
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
            UNFOLLOWED[f"{_name(func)} (rule failed: {type(err).__name__})"] += 1
            self.put_all(out, self.lost(f"{_name(func)}, which the batch tracker failed to follow ({err!r})"))
            return out
        finally:
            self._out = _NOT_RUN

    def run(self, func, args: tuple, kwargs: dict) -> Any:
        """Run the operation (rules call it through here, so that its own errors are told apart)."""
        self._out = _RAISED
        out = func(*args, **kwargs)
        self._out = out
        return out

    # ---------------------------------------------------------------- combining

    def combine(self, items: List[Tuple[Any, int, int]]) -> Tuple[Any, List[int]]:
        """The tag of a result from ``(tag, tensor ndim, result ndim)`` of aligned inputs.

        Returns the tag and the indices (into ``items``) of origin-derived inputs, which meet the
        batch when the tag is a batch dim.
        """
        strong: List[int] = []
        weak: List[int] = []
        lost = None  # the first strong Lost, else the first weak one
        origins: List[int] = []
        for i, (tag, ndim, out_ndim) in enumerate(items):
            if tag is None:
                continue
            if type(tag) is int:  # the aligned dim, with the merged factor (0 if none)
                d = (tag & _DIM) + out_ndim - ndim + (tag & ~(_DIM | WEAK))
                (weak if tag & WEAK else strong).append(d)
            elif type(tag) is Lost:
                if lost is None or (lost.weak and not tag.weak):
                    lost = tag
            else:
                origins.append(i)
        if self.n <= 1:
            lost = None
        if strong:
            if any(d != strong[0] for d in strong) and self.n > 1:
                return Lost("an operation that aligns the batch of one input with another dimension of another"), []
            if lost is not None and not lost.weak:
                return lost, []
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

    def meet(self, use: Tensor, out_ndim: int, out_dim: int, broadcasts: bool = True) -> Tensor:
        """``use`` (origin-derived) meets batched tensors in a result batched along ``out_dim``:
        the tensor to compute with instead, behind a tap that keeps each sample's gradient apart.
        ``broadcasts``: whether the operation broadcasts ``use`` (a size-1 dim) against the batch."""
        origins = self.get(use)
        if not use.requires_grad or type(origins) is not tuple:
            return use
        if out_dim & ~_DIM:  # out_dim carries the merged factor of the batch dim, if any
            raise self.unsupported_meeting(origins, "a tensor whose batch dimension is merged with another")
        lead = out_ndim - use.ndim
        aligned = out_dim - lead
        if lead < 0:
            raise self.unsupported_meeting(origins, "a batched tensor of lower rank")
        view = use[(None,) * lead] if lead else use
        if broadcasts and (aligned < 0 or use.shape[aligned] == 1):
            broadcast = True
            view = view.expand(*[self.n if i == out_dim else -1 for i in range(out_ndim)])
        elif aligned >= 0 and use.shape[aligned] == self.n:
            broadcast = False
        else:
            return use  # the operation itself reports the shape mismatch
        direct = tuple(o for o in origins if o.output() is use)
        chained = tuple(o for o in origins if o.output() is not use)
        edges = tuple(o.edge for o in chained)
        on_backward = partial(_meeting_backward, use if chained else None, tuple(use.shape), direct, chained, edges,
                              broadcast, out_dim, lead, self.n, self.skip, self.quiet)
        return tap((view,), (), on_backward)[0]

    def add_origin(self, origin: OriginCall) -> None:
        self._origins.append(origin)

    def close(self) -> None:
        """End of the root forward: origins drop the graph edge they held for the meetings."""
        for origin in self._origins:
            origin.edge = None
        self._origins.clear()
        self._table.clear()

    def unsupported_meeting(self, origins: Any, where: str) -> PerSampleGradientError:
        names = ", ".join(dict.fromkeys(o.name for o in origins))
        return PerSampleGradientError(
            f"the output of {names}, a layer called on inputs that carry no batch dimension, meets the batch in "
            f"{where}, where its per-sample gradients cannot be kept apart. Give the layer inputs with a leading "
            "batch dimension (e.g. positions[None].expand(batch_size, -1) instead of positions), or freeze its "
            "parameters."
        )


_CACHE: Dict[Any, Callable] = {}
_NOT_RUN: Any = object()
_RAISED: Any = object()


# ---------------------------------------------------------------------------------------------- rules


def _skip(tr, func, args, kwargs):  # identity marker: no tensor result to tag
    return func(*args, **kwargs)


def _untagged(tr, func, args, kwargs):
    """Factories shaped like their input (``zeros_like``, ``new_zeros``): no data of the batch."""
    return tr.run(func, args, kwargs)


def _tensors_of(args: tuple, kwargs: dict):
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            yield ("a", i), a
    for k, a in kwargs.items():
        if isinstance(a, Tensor):
            yield ("k", k), a


def _replace(args: tuple, kwargs: dict, where, value):
    if where[0] == "a":
        args = args[: where[1]] + (value,) + args[where[1] + 1 :]
    else:
        kwargs = dict(kwargs)
        kwargs[where[1]] = value
    return args, kwargs


def _broadcast(tr: BatchTracker, func, args, kwargs, inplace: bool = False, name: str = ""):
    """Elementwise operations, broadcasting their tensor arguments."""
    if not inplace:  # fast path: one tagged argument (the others shared), nothing meets
        table = tr._table
        single = None
        for a in args if not kwargs else (*args, *kwargs.values()):
            if isinstance(a, Tensor):
                entry = table.get(id(a))
                if entry is not None and entry[0]() is a:
                    if single is not None:
                        single = None
                        break
                    single = (a, entry[1])
        else:
            if single is not None:
                out = tr.run(func, args, kwargs)
                tag = single[1]
                if isinstance(out, Tensor):
                    tr.put(out, tag + (out.ndim - single[0].ndim) if type(tag) is int else tag)
                return out
    tensors = list(_tensors_of(args, kwargs))
    if inplace and tensors and tensors[0][0] == ("a", 0):
        out_ndim = tensors[0][1].ndim
    else:
        out_ndim = max(t.ndim for _, t in tensors)
    tags = [tr.get(t) for _, t in tensors]
    if name == "copy_":  # the values are src's; self's old tag goes
        tags[0] = None
    tag, meeting = tr.combine([(g, t.ndim, out_ndim) for g, (_, t) in zip(tags, tensors)])
    for i in meeting:
        where, t = tensors[i]
        if inplace and where == ("a", 0):
            raise tr.unsupported_meeting(tags[i], f"an in-place {name or 'operation'} that writes the batch into it")
        args, kwargs = _replace(args, kwargs, where, tr.meet(t, out_ndim, tag & ~WEAK))
    out = tr.run(func, args, kwargs)
    if inplace:
        target = args[0]
        old = tags[0] if name != "copy_" else tr.get(target)
        tr.put(target, tag)
        if tag is not None and type(tag) is int and type(old) is not int:
            _to_base(tr, target, tag)
    else:
        tr.put_all(out, tag)
    return out


def _to_base(tr: BatchTracker, view: Tensor, tag: Any) -> None:
    """An in-place write made ``view`` batched: tell its base, if the stride of the batch dim says where."""
    base = view._base
    if base is None:
        return
    d = tag & _DIM
    old = tr.get(base)
    candidates = [j for j in range(base.ndim) if base.stride(j) == view.stride(d) and base.shape[j] == view.shape[d]]
    if len(candidates) == 1 and (old is None or type(old) is tuple or (type(old) is int and old & _DIM == candidates[0])):
        tr.put(base, (tag & _KEEP) | candidates[0])
    elif not (type(old) is int and old & _DIM in candidates):
        tr.put(base, tr.lost("an in-place write of batched values into a view of a shared tensor", tag))


def _self_only(tr, func, args, kwargs):
    """``x.to(other)``, ``x.type_as(other)``: the result is ``x``'s data."""
    x = _arg(args, kwargs, 0, "input")
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if tag is not None:
        tr.put_all(out, tag)
    return out


def _structural(dimfn: Callable, inplace: bool = False):
    """Operations moving ``x``'s dims: ``dimfn(d, shape, args, kwargs, out)`` is the new dim or a reason."""

    def rule(tr: BatchTracker, func, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        tag = tr.get(x)
        shape = tuple(x.shape)
        out = tr.run(func, args, kwargs)
        if tag is None:
            return out
        if type(tag) is int:
            new = dimfn(tag & _DIM, shape, args, kwargs, out if not inplace else x)
            tag = (tag & _KEEP) | new if type(new) is int else tr.lost(f"{_name(func)} ({new})", tag)
        if inplace:
            tr.put(x, tag)
        else:
            tr.put_all(out, tag)
        return out

    return rule


def _name(func) -> str:
    return getattr(func, "__name__", repr(func))


# ---- dim functions (d: the batch dim of x; shape: x's shape before the operation)


def _d_transpose(d, shape, args, kwargs, out):
    ndim = len(shape)
    if ndim < 2:
        return d
    a = _norm_dim(int(_arg(args, kwargs, 1, "dim0", kwargs.get("axis0", 0))), ndim)
    b = _norm_dim(int(_arg(args, kwargs, 2, "dim1", kwargs.get("axis1", 1))), ndim)
    return b if d == a else a if d == b else d


def _d_t(d, shape, args, kwargs, out):
    return 1 - d if len(shape) == 2 else d


def _d_reverse(d, shape, args, kwargs, out):
    return len(shape) - 1 - d


def _d_swap_last(d, shape, args, kwargs, out):
    ndim = len(shape)
    return ndim - 1 if d == ndim - 2 else ndim - 2 if d == ndim - 1 else d


def _d_permute(d, shape, args, kwargs, out):
    dims = _shape_args(args, 1) if len(args) > 1 else tuple(kwargs["dims"])
    dims = [_norm_dim(int(p), len(shape)) for p in dims]
    return dims.index(d)


def _d_movedim(d, shape, args, kwargs, out):
    ndim = len(shape)
    src = _arg(args, kwargs, 1, "source")
    dst = _arg(args, kwargs, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src = [_norm_dim(s, ndim) for s in src]
    dst = [_norm_dim(s, ndim) for s in dst]
    order = [None] * ndim
    for s, t in zip(src, dst):
        order[t] = s
    rest = iter(i for i in range(ndim) if i not in src)
    order = [o if o is not None else next(rest) for o in order]
    return order.index(d)


def _d_unsqueeze(d, shape, args, kwargs, out):
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dim")), len(shape) + 1)
    return d + 1 if dim <= d else d


def _d_squeeze(d, shape, args, kwargs, out):
    dims = _dims_arg(_arg(args, kwargs, 1, "dim"), len(shape))
    removed = [i for i in (range(len(shape)) if dims is None else dims) if i < len(shape) and shape[i] == 1]
    if d in removed:
        return "squeezes the batch dimension"
    return d - sum(1 for i in removed if i < d)


def _reshape(tr: BatchTracker, func, args, kwargs):
    """view, reshape, flatten, unflatten...: the batch dim keeps its place in the row-major order."""
    x = args[0] if args else next(iter(kwargs.values()))
    tag = tr.get(x)
    shape = tuple(x.shape)
    out = tr.run(func, args, kwargs)
    if type(tag) is not int:
        if tag is not None:
            tr.put(out, tag)
        return out
    d, inner = tag & _DIM, tag // INNER
    if len(args) > 1 and isinstance(args[1], torch.dtype):  # x.view(dtype)
        new = (d, max(inner, 1)) if d < len(shape) - 1 else None
    else:
        new = _regroup(shape, tuple(out.shape), d, max(inner, 1), tr.n)
    if new is None:
        tr.put(out, tr.lost(f"{_name(func)} (splits the batch dimension or interleaves it with another)", tag))
    else:
        tr.put(out, (tag & WEAK) | new[0] | (new[1] * INNER if new[1] > 1 else 0))
    return out


def _d_expand(d, shape, args, kwargs, out):
    return d + out.ndim - len(shape)


def _d_repeat(d, shape, args, kwargs, out):
    sizes = _shape_args(args, 1) if len(args) > 1 else tuple(kwargs.get("repeats", kwargs.get("dims", ())))
    lead = len(sizes) - len(shape)
    factor = sizes[d + lead] if len(sizes) > d + lead >= 0 else 1
    return d + max(lead, 0) if factor == 1 else "repeats the batch"


def _dim_is_batch(pos: int, name: str, default: Any = None, reason: str = "operates along the batch dimension"):
    def dimfn(d, shape, args, kwargs, out):
        dims = _dims_arg(_arg(args, kwargs, pos, name, default), len(shape))
        return reason if dims is None or d in dims else d

    return dimfn


def _d_repeat_interleave(d, shape, args, kwargs, out):
    dim = _arg(args, kwargs, 2, "dim")
    if dim is None or _norm_dim(int(dim), len(shape)) == d:
        return "repeats rows of the batch"
    return d


def _d_narrow(d, shape, args, kwargs, out):
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dim")), len(shape))
    return d if dim != d or out.shape[d] == shape[d] else "keeps part of the batch"


def _d_select(d, shape, args, kwargs, out):
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dim")), len(shape))
    return "selects one sample" if dim == d else d - (1 if dim < d else 0)


def _d_unfold(d, shape, args, kwargs, out):
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dimension")), len(shape))
    return "unfolds the batch dimension" if dim == d else d


def _d_keep_leading(nkeep_from_end: int):
    """Dims before the last ``nkeep_from_end`` stay (linear's features, layer_norm's shape...)."""

    def dimfn(d, shape, args, kwargs, out):
        return d if d < len(shape) - nkeep_from_end else "mixes the batch dimension"

    return dimfn


def _d_first(d, shape, args, kwargs, out):
    return d if d == 0 else "expects the batch along dim 0"


def _d_first_two(d, shape, args, kwargs, out):
    return d if d in (0, 1) else "works across the batch dimension"


def _d_leading(d, shape, args, kwargs, out):  # embedding, one_hot: new trailing dims
    return d


def _d_pad(d, shape, args, kwargs, out):
    pad = _arg(args, kwargs, 1, "pad")
    ndim = len(shape)
    for i in range(len(pad) // 2):
        if ndim - 1 - i == d and (pad[2 * i] or pad[2 * i + 1]):
            return "pads the batch dimension"
    return d


def _d_roll(d, shape, args, kwargs, out):
    dims = _arg(args, kwargs, 2, "dims")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return "rolls the flattened batch"
    return "reorders the batch" if d in _dims_arg(dims, len(shape)) else d


def _d_flip(d, shape, args, kwargs, out):
    dims = _shape_args(args, 1) if len(args) > 1 else tuple(kwargs.get("dims", ()))
    return "reorders the batch" if d in [_norm_dim(int(x), len(shape)) for x in dims] else d


def _d_rot90(d, shape, args, kwargs, out):
    dims = _arg(args, kwargs, 2, "dims", (0, 1))
    return "reorders the batch" if d in [_norm_dim(int(x), len(shape)) for x in dims] else d


def _d_group_norm(d, shape, args, kwargs, out):
    return d if d == 0 else "normalises across the batch dimension"


def _d_batch_norm(d, shape, args, kwargs, out):
    training = _arg(args, kwargs, 5, "training", False)
    if training:
        return "batch normalisation in training mode (batch statistics mix the samples)"
    return d if d != 1 else "normalises across the batch dimension"


def _d_layer_norm(d, shape, args, kwargs, out):
    normalized = _arg(args, kwargs, 1, "normalized_shape")
    count = 1 if isinstance(normalized, int) else len(normalized)
    return d if d < len(shape) - count else "normalises across the batch dimension"


def _d_softmax(d, shape, args, kwargs, out):
    dim = _arg(args, kwargs, 1, "dim")
    if dim is None:
        dim = 0 if len(shape) in (0, 1, 3) else 1
    return "normalises across the batch dimension" if _norm_dim(int(dim), len(shape)) == d else d


def _d_view_as_real(d, shape, args, kwargs, out):
    return d


# ---- reductions


_KEEPDIM_AT = {"std": 3, "var": 3, "std_mean": 3, "var_mean": 3, "norm": 3, "median": 2, "nanmedian": 2, "mode": 2,
               "kthvalue": 3}
_DIM_AT = {"norm": 2, "kthvalue": 2}
_DEFAULT_DIM = {"mode": -1, "kthvalue": -1}


def _reduction(tr: BatchTracker, func, args, kwargs):
    name = _name(func)
    if name in ("max", "min") and len(args) > 1 and isinstance(args[1], Tensor):
        return _broadcast(tr, func, args, kwargs)
    x = args[0] if args else kwargs.get("input")
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if tag is None:
        return out
    if type(tag) is int:
        ndim = x.ndim
        dim = _arg(args, kwargs, _DIM_AT.get(name, 1), "dim", kwargs.get("axis", _DEFAULT_DIM.get(name)))
        if isinstance(dim, bool) or isinstance(dim, str):  # std(unbiased), norm(p) overloads
            dim = kwargs.get("dim")
        keepdim = _arg(args, kwargs, _KEEPDIM_AT.get(name, 2), "keepdim", False)
        keepdim = keepdim if isinstance(keepdim, bool) else False
        dims = _dims_arg(dim, ndim)
        d = tag & _DIM
        if dims is None or d in dims:
            tag = tr.lost(f"{name} over the batch dimension", tag)
        else:
            tag = (tag & _KEEP) | (d if keepdim else d - sum(1 for i in dims if i < d))
    tr.put_all(out, tag)
    return out


# ---- contractions


def _matmul_dims(d: int, ndim: int, other_ndim: int, out_ndim: int, left: bool) -> Any:
    """The result dim of an operand's dim ``d`` in ``left @ right``, or a reason."""
    if ndim == 1:
        return "contracts the batch dimension"
    if left:
        if d == ndim - 1:
            return "contracts the batch dimension"
        if d == ndim - 2:
            return out_ndim - 2 if other_ndim > 1 else out_ndim - 1
    else:
        if d == ndim - 2:
            return "contracts the batch dimension"
        if d == ndim - 1:
            return out_ndim - 1
    return d + (out_ndim - (2 if other_ndim > 1 else 1)) - (ndim - 2)


def _matmul(tr: BatchTracker, func, args, kwargs):
    name = _name(func)
    if name == "__rmatmul__":
        return _matmul_pair(tr, func, args, kwargs, 1, 0)
    return _matmul_pair(tr, func, args, kwargs, 0, 1)


def _matmul_pair(tr, func, args, kwargs, ia, ib, extra: Optional[int] = None):
    a, b = args[ia], args[ib]
    ta, tb = tr.get(a), tr.get(b)
    te = tr.get(args[extra]) if extra is not None else None
    out_ndim = max(a.ndim, b.ndim) if a.ndim > 1 and b.ndim > 1 else max(a.ndim, b.ndim) - 1
    items = []
    for t, tag, left, other in ((a, ta, True, b), (b, tb, False, a)):
        if type(tag) is int:
            new = _matmul_dims(tag & _DIM, t.ndim, other.ndim, out_ndim, left)
            items.append(((tag & _KEEP) | new if type(new) is int else tr.lost(f"{_name(func)} {new}", tag), out_ndim, out_ndim))
        else:
            items.append((tag, out_ndim, out_ndim))
    if extra is not None:
        items.append((te, args[extra].ndim, out_ndim))
    tag, meeting = tr.combine(items)
    for i in meeting:
        t, pos = ((a, ia), (b, ib), (args[extra] if extra is not None else None, extra))[i]
        if i < 2 and (t.ndim < 2 or (tag & _DIM) >= out_ndim - 2):
            raise tr.unsupported_meeting(items[i][0], f"{_name(func)} along the matrix dimensions")
        # broadcast (batch) dims of a matrix operand align with the result's like elementwise ones
        args = args[:pos] + (tr.meet(t, out_ndim, tag & ~WEAK),) + args[pos + 1 :]
    out = tr.run(func, args, kwargs)
    tr.put_all(out, tag)
    return out


_ADDMM_NAMES = {"addmm": ("input", "mat1", "mat2"), "baddbmm": ("input", "batch1", "batch2"),
                "addmv": ("input", "mat", "vec")}


def _addmm(tr, func, args, kwargs):  # addmm(input, m1, m2), baddbmm(input, b1, b2), addmv, addbmm
    name = _name(func)
    if name == "addbmm":
        return _lost_if_tagged(tr, func, args, kwargs, "addbmm sums over the batch of matrices")
    names = _ADDMM_NAMES[name]
    if len(args) < 3:  # keyword operands (BLOOM's alibi.baddbmm(batch1=..., batch2=...)): call positionally
        kwargs = dict(kwargs)
        args = tuple(args) + tuple(kwargs.pop(k) for k in names[len(args):])
    return _matmul_pair(tr, func, args, kwargs, 1, 2, extra=0)


def _linear(tr: BatchTracker, func, args, kwargs):
    x = _arg(args, kwargs, 0, "input")
    weight = _arg(args, kwargs, 1, "weight")
    bias = _arg(args, kwargs, 2, "bias")
    tag = tr.get(x)
    others = [tr.get(w) for w in (weight, bias) if isinstance(w, Tensor)]
    if any(type(o) is tuple for o in others) and type(tag) is int and tr.n > 1:
        raise tr.unsupported_meeting(next(o for o in others if type(o) is tuple), "linear as its weight")
    out = tr.run(func, args, kwargs)
    if any(type(o) is int or type(o) is Lost for o in others):
        tr.put(out, tr.lost_from("linear with weights derived from the batch", others))
    elif type(tag) is int:
        d = tag & _DIM
        tr.put(out, tag if d < x.ndim - 1 else tr.lost("linear over the batch dimension", tag))
    elif tag is not None or any(type(o) is tuple for o in others):
        tr.put(out, tag if tag is not None else next(o for o in others if type(o) is tuple))
    return out


def _einsum(tr: BatchTracker, func, args, kwargs):
    equation = args[0]
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    tags = [tr.get(t) for t in operands]
    out = tr.run(func, args, kwargs)
    try:
        result = _einsum_tag(tr, equation, operands, tags)
    except (ValueError, IndexError):
        result = tr.lost("einsum (equation not understood)")
    if any(type(t) is tuple for t in tags) and type(result) is int:
        raise tr.unsupported_meeting(next(t for t in tags if type(t) is tuple), "einsum")
    tr.put(out, result)
    return out


def _einsum_tag(tr: BatchTracker, equation: str, operands: List[Tensor], tags: List[Any]) -> Any:
    equation = equation.replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    inputs = lhs.split(",")
    ell = max((t.ndim - len(s.replace("...", "")) for s, t in zip(inputs, operands) if "..." in s), default=0)
    marks = [chr(0x100 + i) for i in range(ell)]

    def expand(sub: str, ndim: int) -> str:
        if "..." not in sub:
            return sub
        k = ndim - len(sub.replace("...", ""))
        return sub.replace("...", "".join(marks[ell - k :]))

    subs = [expand(s, t.ndim) for s, t in zip(inputs, operands)]
    if "->" in equation:
        output = rhs.replace("...", "".join(marks))
    else:
        letters = "".join(subs)
        output = "".join(marks) + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in marks))
    items = []
    for sub, tag in zip(subs, tags):
        if type(tag) is int:
            letter = sub[tag & _DIM]
            if letter in output:
                items.append(((tag & _KEEP) | output.index(letter), len(output), len(output)))
            else:
                items.append((tr.lost("einsum contracts the batch dimension", tag), 0, 0))
        else:
            items.append((tag, 0, 0))
    return tr.combine(items)[0]


def _sdpa(tr: BatchTracker, func, args, kwargs):
    names = ("query", "key", "value", "attn_mask")
    values = [_arg(args, kwargs, i, n) for i, n in enumerate(names)]
    q = values[0]
    out_ndim = q.ndim
    items = []
    for i, t in enumerate(values):
        tag = tr.get(t) if isinstance(t, Tensor) else None
        if type(tag) is int:
            d = tag & _DIM
            if i == 3:
                pos = d + out_ndim - t.ndim
                bad = pos == out_ndim - 1
            else:
                pos = d + out_ndim - t.ndim
                bad = d == t.ndim - 1 or (i > 0 and d == t.ndim - 2)
            tag = tr.lost("attention across the batch dimension", tag) if bad else (tag & _KEEP) | pos
            items.append((tag, out_ndim, out_ndim))
        else:
            items.append((tag, out_ndim, out_ndim))
    tag, meeting = tr.combine(items)
    for i in meeting:
        t = values[i]
        if i != 3 or (tag & _DIM) >= out_ndim - 2:
            raise tr.unsupported_meeting(items[i][0], "scaled_dot_product_attention as query, key or value")
        substitute = tr.meet(t, out_ndim, tag & ~WEAK)
        if len(args) > 3:
            args = args[:3] + (substitute,) + args[4:]
        else:
            kwargs = dict(kwargs, attn_mask=substitute)
    out = tr.run(func, args, kwargs)
    tr.put(out, tag)
    return out


# ---- joining, splitting, indexing


def _cat(tr: BatchTracker, func, args, kwargs):
    tensors = list(_arg(args, kwargs, 0, "tensors"))
    dim = _arg(args, kwargs, 1, "dim", 0)
    stack = _name(func) == "stack"
    ref = next((t for t in tensors if t.ndim), tensors[0])
    ndim = ref.ndim + (1 if stack else 0)
    dim = _norm_dim(int(dim), ndim)
    items = []
    for t in tensors:
        tag = tr.get(t)
        if type(tag) is int:
            d = tag & _DIM
            if stack:
                d = d + 1 if d >= dim else d
            elif d == dim:
                tag = tr.lost("concatenates along the batch dimension", tag)
                items.append((tag, ndim, ndim))
                continue
            items.append(((tag & _KEEP) | d, ndim, ndim))
        else:
            items.append((tag, ndim, ndim))
    tag, meeting = tr.combine(items)
    if meeting:
        tensors = list(tensors)
        for i in meeting:
            tensors[i] = tr.meet(tensors[i], tensors[i].ndim, (tag & ~WEAK) - (1 if stack and (tag & _DIM) > dim else 0),
                                 broadcasts=False)
        args = (tensors,) + tuple(args[1:]) if args else args
        if not args:
            kwargs = dict(kwargs, tensors=tensors)
    out = tr.run(func, args, kwargs)
    tr.put(out, tag)
    return out


def _split(tr: BatchTracker, func, args, kwargs):
    name = _name(func)
    x = args[0]
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if tag is None:
        return out
    if type(tag) is int:
        d = tag & _DIM
        if name == "unbind":
            dim = _norm_dim(int(_arg(args, kwargs, 1, "dim", 0)), x.ndim)
            tag = tr.lost("unbinds the batch", tag) if dim == d else (tag & _KEEP) | (d - (1 if dim < d else 0))
        else:
            dim = _norm_dim(int(_arg(args, kwargs, 2, "dim", 0)), x.ndim)
            if dim == d and not (len(out) == 1 and out[0].shape[d] == x.shape[d]):
                tag = tr.lost(f"{name} along the batch dimension", tag)
    tr.put_all(out, tag)
    return out


def _gather(tr: BatchTracker, func, args, kwargs):
    """gather(x, dim, index), take_along_dim(x, index, dim), scatter*(x, dim, index, src), index_*(x, dim, index, src)."""
    name = _name(func).rstrip("_")
    inplace = _name(func).endswith("_")
    x = args[0]
    if name == "take_along_dim":
        dim = _arg(args, kwargs, 2, "dim")
    else:
        dim = _arg(args, kwargs, 1, "dim")
    dim = None if dim is None else _norm_dim(int(dim), max(x.ndim, 1))
    parts = [t for _, t in _tensors_of(args, kwargs)]
    if name.startswith("index_"):
        parts = [t for t in parts if t.ndim == x.ndim or t is x]  # the 1-D index does not align
    out_ndim = x.ndim
    items = []
    for t in parts:
        tag = tr.get(t)
        if type(tag) is int and (dim is None or (tag & _DIM) + out_ndim - t.ndim == dim):
            tag = tr.lost(f"{name} along the batch dimension", tag)
        items.append((tag, t.ndim, out_ndim))
    tag, meeting = tr.combine(items)
    if meeting:
        raise tr.unsupported_meeting(items[meeting[0]][0], name)
    out = tr.run(func, args, kwargs)
    tr.put(x if inplace else out, tag)
    return out


def _take(tr, func, args, kwargs):
    x, index = args[0], _arg(args, kwargs, 1, "index")
    tx, ti = tr.get(x), tr.get(index)
    out = tr.run(func, args, kwargs)
    if tx is not None and type(tx) is not tuple:
        tr.put(out, tr.lost("take over the flattened batch", tx))
    elif type(tx) is tuple and type(ti) is int:
        raise tr.unsupported_meeting(tx, "take with batched indices")
    else:
        tr.put(out, ti if ti is not None else tx)
    return out


def _index_layout(x: Tensor, index: Any):
    """For ``x[index]``: the result's dims as sources (an int: a dim of x; None: a new dim; "A": the
    advanced-index block), the advanced index tensors, x's dims consumed by advanced or integer
    indices, and x's dims sliced partially."""
    items = index if isinstance(index, tuple) else (index,)
    consumed = 0
    for it in items:
        if it is None or it is Ellipsis:
            continue
        if isinstance(it, Tensor) and it.dtype in (torch.bool, torch.uint8):
            consumed += max(it.ndim, 1)
        elif isinstance(it, bool):
            continue
        else:
            consumed += 1
    fill = x.ndim - consumed
    layout: List[Any] = []
    advanced: List[Tuple[Any, List[int]]] = []
    removed: List[int] = []
    partial_: List[int] = []
    src = 0
    for it in items:
        if it is None or isinstance(it, bool):
            layout.append(None)
        elif it is Ellipsis:
            for _ in range(fill):
                layout.append(src)
                src += 1
        elif isinstance(it, slice):
            size = x.shape[src]
            full = (it.start in (None, 0) or it.start <= -size) and (it.stop is None or it.stop >= size) and it.step in (None, 1)
            if not full:
                partial_.append(src)
            layout.append(src)
            src += 1
        elif isinstance(it, (Tensor, list)):
            k = max(it.ndim, 1) if isinstance(it, Tensor) and it.dtype in (torch.bool, torch.uint8) else 1
            if isinstance(it, Tensor) and it.ndim == 0 and it.dtype not in (torch.bool, torch.uint8):
                removed.append(src)
                advanced.append((it, [src]))
            else:
                advanced.append((it, list(range(src, src + k))))
                layout.append("A")
            src += k
        else:  # an integer
            removed.append(src)
            src += 1
    while src < x.ndim:
        layout.append(src)
        src += 1
    return layout, advanced, removed, partial_


def _identity_index_dim(index: Any, n: int) -> Optional[int]:
    """The dim along which an integer index tensor is ``arange(n)`` (sizes 1 elsewhere), else None."""
    if not isinstance(index, Tensor) or index.dtype in (torch.bool, torch.uint8) or index.numel() != n:
        return None
    dims = [i for i, s in enumerate(index.shape) if s != 1]
    if len(dims) > 1 or (not dims and n != 1):
        return None
    if not torch.equal(index.reshape(-1).to("cpu"), torch.arange(n)):
        return None
    return dims[0] if dims else 0


def _advanced_block(layout: List[Any], advanced) -> Tuple[List[Any], int, int]:
    """Replace the "A" markers by the advanced block: (layout, block start, block rank)."""
    rank = 0
    for it, dims in advanced:
        if isinstance(it, Tensor):
            rank = max(rank, 1 if it.dtype in (torch.bool, torch.uint8) else it.ndim)
        else:
            rank = max(rank, 1)
    marks = [i for i, s in enumerate(layout) if s == "A"]
    if not marks:
        return layout, 0, 0
    rest = [s for s in layout if s != "A"]
    contiguous = marks == list(range(marks[0], marks[0] + len(marks)))
    start = marks[0] if contiguous else 0
    return rest[:start] + ["A"] * rank + rest[start:], start, rank


def _getitem(tr: BatchTracker, func, args, kwargs):
    x, index = args[0], args[1]
    xtag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if not isinstance(out, Tensor):
        return out
    try:
        tag = _index_tag(tr, x, index, xtag, out.ndim)
    except (TypeError, ValueError, IndexError):
        tag = tr.lost("indexing the tracker does not follow", xtag) if xtag is not None else None
    tr.put(out, tag)
    return out


def _index_tag(tr: BatchTracker, x: Tensor, index: Any, xtag: Any, out_ndim: int) -> Any:
    layout, advanced, removed, partial_ = _index_layout(x, index)
    layout, start, rank = _advanced_block(layout, advanced)
    items = []
    if type(xtag) is int:
        d = xtag & _DIM
        if d in removed:
            return tr.lost("indexes one sample", xtag)
        by = next((it for it, dims in advanced if d in dims), None)
        if by is not None:
            at = _identity_index_dim(by, x.shape[d])
            if at is None:
                return tr.lost("indexes the batch dimension with a tensor", xtag)
            # x[arange(n)[:, None], ...]: row i of the result is sample i's (HF's padding masks, pooling)
            items.append(((xtag & _KEEP) | (start + at + rank - by.ndim), out_ndim, out_ndim))
        elif d in partial_:
            return tr.lost("slices part of the batch", xtag)
        else:
            items.append(((xtag & _KEEP) | layout.index(d), out_ndim, out_ndim))
    else:
        items.append((xtag, out_ndim, out_ndim))
    for it, _ in advanced:
        if isinstance(it, Tensor):
            tag = tr.get(it)
            if type(tag) is int:
                if it.dtype in (torch.bool, torch.uint8):
                    tag = tr.lost("a boolean mask over the batch", tag)
                else:
                    tag = (tag & _KEEP) | (start + (tag & _DIM) + rank - it.ndim)
            elif type(tag) is tuple:
                tag = None  # indices carry no gradient
            items.append((tag, out_ndim, out_ndim))
    tag, meeting = tr.combine(items)
    if meeting:
        raise tr.unsupported_meeting(items[meeting[0]][0], "indexing with batched indices")
    return tag


def _setitem(tr: BatchTracker, func, args, kwargs):
    x, index, value = args[0], args[1], args[2]
    xtag = tr.get(x)
    vtag = tr.get(value) if isinstance(value, Tensor) else None
    if vtag is None:
        out = tr.run(func, args, kwargs)
        return out
    try:
        layout, advanced, removed, partial_ = _index_layout(x, index)
        layout, start, rank = _advanced_block(layout, advanced)
    except (TypeError, ValueError, IndexError):
        layout = None
    region_ndim = len(layout) if layout is not None else 0
    new = xtag
    if type(vtag) is int and layout is not None:
        r = (vtag & _DIM) + region_ndim - value.ndim
        src = layout[r] if 0 <= r < region_ndim else None
        if type(src) is int:
            new = tr.combine([((vtag & _KEEP) | src, x.ndim, x.ndim), (xtag if type(xtag) is not tuple else None, x.ndim, x.ndim)])[0]
            if type(xtag) is tuple:
                new = tr.lost("batched values written into a shared tensor", vtag)
        else:
            new = tr.lost("batched values written across the batch dimension", vtag)
    elif type(vtag) is int:
        new = tr.lost("batched values written by an index the tracker does not follow", vtag)
    elif type(vtag) is Lost:
        new = vtag if xtag is None or type(xtag) is not int else tr.lost(vtag.reason, vtag)
    elif type(vtag) is tuple:
        if type(xtag) is int and layout is not None and (xtag & _DIM) in layout:
            value = tr.meet(value, region_ndim, layout.index(xtag & _DIM) + (xtag & ~(_DIM | WEAK)))
            args = (x, index, value)
        elif type(xtag) is int:
            raise tr.unsupported_meeting(vtag, "an indexed assignment")
        elif xtag is None or type(xtag) is tuple:
            new = vtag if xtag is None else tuple(dict.fromkeys(xtag + vtag))
    out = tr.run(func, args, kwargs)
    tr.put(x, new)
    if type(new) is int and type(xtag) is not int:
        _to_base(tr, x, new)
    return out


def _pad_packed(tr: BatchTracker, func, args, kwargs):
    data = args[0]
    dim = 0 if bool(_arg(args, kwargs, 2, "batch_first", False)) else 1
    tag = tr.get(data)
    out = tr.run(func, args, kwargs)
    if type(tag) is Lost and tag.kind == "packed":
        # rows in the packed (sorted) order; pad_packed_sequence gathers them back with unsorted_indices
        tr.put(out[0], dim if tag.order is None else Lost("the batch in sorted order", "permuted", dim, tag.order))
    elif tag is not None:
        tr.put(out[0], tag if type(tag) is tuple else tr.lost("pads data that is not a PackedSequence's"))
    return out


def _pack_padded(tr: BatchTracker, func, args, kwargs):
    x = args[0]
    dim = 0 if bool(_arg(args, kwargs, 2, "batch_first", False)) else 1
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if type(tag) is int and (tag & ~WEAK) == dim:
        tr.put(out[0], PACKED)
    elif type(tag) is Lost and tag.kind == "permuted" and tag.dim == dim:
        tr.put(out[0], packed(tag.order))
    elif tag is not None:
        tr.put(out[0], tr.lost("packs a tensor whose batch is not where pack_padded_sequence expects it"))
    return out


def _index_select(tr: BatchTracker, func, args, kwargs):
    """index_select along the batch dim: a permutation of the rows keeps track of their samples."""
    x = args[0]
    tag = tr.get(x)
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dim")), max(x.ndim, 1))
    index = _arg(args, kwargs, 2, "index")
    out = tr.run(func, args, kwargs)
    if tag is None:
        return out
    if type(tag) is int and (tag & ~WEAK) == dim:
        tag = _reorder(tr, tag, None, dim, index, x.shape[dim])
    elif type(tag) is int and (tag & _DIM) == dim:
        tag = tr.lost("index_select along a merged batch dimension", tag)
    elif type(tag) is Lost and tag.kind == "permuted" and tag.dim == dim:
        tag = _reorder(tr, dim, tag.order, dim, index, x.shape[dim])
    tr.put(out, tag)
    return out


def _reorder(tr: BatchTracker, tag: int, order: Optional[Tensor], dim: int, index: Tensor, n: int) -> Any:
    index = index.reshape(-1).to("cpu")
    identity = torch.arange(n)
    new = index if order is None else order.to("cpu")[index]
    if torch.equal(new, identity):
        return tag
    if new.numel() == n and torch.equal(new.sort().values, identity):
        return Lost("the batch in another order", "permuted", dim, new, weak=bool(tag & WEAK))
    return tr.lost("index_select along the batch dimension", tag)


def _embedding_bag(tr: BatchTracker, func, args, kwargs):
    x = _arg(args, kwargs, 0, "input")
    offsets = _arg(args, kwargs, 2, "offsets")
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    result = out[0] if isinstance(out, tuple) else out
    if x.ndim == 2:
        new = tag if type(tag) is not int or tag & _DIM == 0 else tr.lost("embedding_bag across the batch", tag)
    else:
        otag = tr.get(offsets) if isinstance(offsets, Tensor) else None
        new = otag if type(otag) is int and otag & _DIM == 0 else (tag if tag is None or type(tag) is tuple else tr.lost("embedding_bag of flat indices", tag))
    tr.put(result, new)
    return out


def _loss(tr: BatchTracker, func, args, kwargs):
    x = args[0] if args else kwargs.get("input")
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if tag is None and not any(tr.get(t) is not None for _, t in _tensors_of(args, kwargs)):
        return out
    if isinstance(out, Tensor) and out.ndim and type(tag) is int and tag & _DIM == 0:
        tr.put(out, tag)
    else:
        tr.put(out, tr.lost_from(f"{_name(func)} (a loss over the batch)", [tr.get(t) for _, t in _tensors_of(args, kwargs)]))
    return out


def _lost_if_tagged(tr, func, args, kwargs, reason: Optional[str] = None):
    tags = [tr.get(t) for _, t in _tensors_of(args, kwargs)]
    out = tr.run(func, args, kwargs)
    tr.put_all(out, tr.lost_from(reason or f"{_name(func)}, which the tracker does not follow", tags))
    return out


def _cosine(tr: BatchTracker, func, args, kwargs):  # cosine_similarity(x1, x2, dim=1), pairwise_distance
    name = _name(func)
    x1, x2 = args[0], args[1]
    out_ndim = max(x1.ndim, x2.ndim)
    tag = tr.combine([(tr.get(x1), x1.ndim, out_ndim), (tr.get(x2), x2.ndim, out_ndim)])[0]
    out = tr.run(func, args, kwargs)
    if type(tag) is int:
        dim = out_ndim - 1 if name == "pairwise_distance" else _norm_dim(int(_arg(args, kwargs, 2, "dim", 1)), out_ndim)
        keep = name == "pairwise_distance" and bool(_arg(args, kwargs, 4, "keepdim", False))
        d = tag & _DIM
        tag = tr.lost(f"{name} across the batch dimension", tag) if d == dim else (tag & _KEEP) | (d if keep or d < dim else d - 1)
    tr.put(out, tag)
    return out


def _default(tr: BatchTracker, func, args, kwargs):
    """An operation without a rule: outputs shaped exactly like a batched input keep its tag;
    other tensor outputs lose the batch (so a layer fed them is refused, naming the operation)."""
    name = _name(func)
    UNFOLLOWED[name] += 1
    tensors = [t for _, t in _tensors_of(args, kwargs)] + [b for a in args if isinstance(a, (list, tuple)) for b in a if isinstance(b, Tensor)]
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


# ---------------------------------------------------------------------------------------------- the table

_BROADCAST = """
abs absolute neg negative exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sin cos tan tanh sigmoid relu relu6 gelu silu
mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid softplus softsign tanhshrink logsigmoid sign sgn floor ceil
round trunc frac fix reciprocal square erf erfc erfinv sinh cosh asin acos atan arcsin arccos arctan asinh acosh atanh
arcsinh arccosh arctanh isnan isinf isfinite isneginf isposinf isreal logical_not bitwise_not nan_to_num clamp clip
clamp_min clamp_max dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout clone contiguous detach
float double half bfloat16 int long short bool char byte cpu cuda pin_memory requires_grad_ conj resolve_conj
resolve_neg tril triu threshold hardshrink softshrink rrelu logit sinc deg2rad rad2deg digamma lgamma polygamma i0
sigmoid_ silu_ bernoulli fill zero normal uniform fill_ zero_ normal_ uniform_ exponential_ random_ geometric_ cauchy_
log_normal_ add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow float_power maximum
minimum fmax fmin where masked_fill lerp addcmul addcdiv eq ne lt le gt ge equal greater less greater_equal less_equal
not_equal logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift
atan2 arctan2 hypot copysign xlogy heaviside nextafter ldexp isclose rsub copy_ masked_scatter prelu
__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __div__ __rdiv__ __floordiv__
__rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__ __lshift__
__rlshift__ __rshift__ __rrshift__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __neg__ __pos__ __abs__ __invert__
positive get:data get:real get:imag alias
"""

_INPLACE_ALIASES = {"__iadd__": "add", "__isub__": "sub", "__imul__": "mul", "__itruediv__": "div", "__idiv__": "div",
                    "__ifloordiv__": "floor_divide", "__imod__": "remainder", "__ipow__": "pow", "__iand__": "bitwise_and",
                    "__ior__": "bitwise_or", "__ixor__": "bitwise_xor", "__ilshift__": "bitwise_left_shift",
                    "__irshift__": "bitwise_right_shift"}

_SKIP = """
size dim ndimension numel nelement item tolist numpy data_ptr stride storage_offset is_contiguous element_size
__len__ __bool__ __index__ __int__ __float__ __complex__ __format__ __repr__ __hash__ __reduce_ex__ __deepcopy__
__setstate__ __getstate__ __array__ __iter__ __contains__ register_hook retain_grad backward untyped_storage
storage is_floating_point is_complex is_signed get_device is_pinned is_shared is_set_to type_as_ __dir__
__sizeof__ _is_view is_nonzero has_names is_inference is_same_size dim_order __array_wrap__
"""

_UNTAGGED = """
zeros_like ones_like empty_like full_like rand_like randn_like randint_like new_zeros new_ones new_empty new_full
new_tensor new_empty_strided
"""

_REDUCTIONS = """
sum nansum mean nanmean prod amax amin max min argmax argmin logsumexp norm std var std_mean var_mean all any
count_nonzero median nanmedian mode aminmax
"""

_RULES: Dict[str, Callable] = {}
for _n in _BROADCAST.split():
    _RULES[_n] = _broadcast
for _n in _SKIP.split():
    _RULES[_n] = _skip
for _n in _UNTAGGED.split():
    _RULES[_n] = _untagged
for _n in _REDUCTIONS.split():
    _RULES[_n] = _reduction
_RULES.update({
    "to": _self_only, "type": _self_only, "type_as": _self_only,
    "transpose": _structural(_d_transpose), "swapaxes": _structural(_d_transpose), "swapdims": _structural(_d_transpose),
    "t": _structural(_d_t), "get:T": _structural(_d_reverse), "get:mT": _structural(_d_swap_last),
    "get:mH": _structural(_d_swap_last), "get:H": _structural(_d_t), "adjoint": _structural(_d_swap_last),
    "permute": _structural(_d_permute), "movedim": _structural(_d_movedim), "moveaxis": _structural(_d_movedim),
    "unsqueeze": _structural(_d_unsqueeze), "squeeze": _structural(_d_squeeze),
    "view": _reshape, "reshape": _reshape, "view_as": _reshape, "reshape_as": _reshape, "flatten": _reshape,
    "unflatten": _reshape, "ravel": _reshape,
    "expand": _structural(_d_expand), "expand_as": _structural(_d_expand), "broadcast_to": _structural(_d_expand),
    "repeat": _structural(_d_repeat), "tile": _structural(_d_repeat),
    "repeat_interleave": _structural(_d_repeat_interleave), "narrow": _structural(_d_narrow),
    "select": _structural(_d_select), "index_select": _index_select,
    "unfold": _structural(_d_unfold),
    "softmax": _structural(_d_softmax), "log_softmax": _structural(_d_softmax), "softmin": _structural(_d_softmax),
    "cumsum": _structural(_dim_is_batch(1, "dim")), "cumprod": _structural(_dim_is_batch(1, "dim")),
    "cummax": _structural(_dim_is_batch(1, "dim")), "cummin": _structural(_dim_is_batch(1, "dim")),
    "logcumsumexp": _structural(_dim_is_batch(1, "dim")), "sort": _structural(_dim_is_batch(1, "dim", -1)),
    "argsort": _structural(_dim_is_batch(1, "dim", -1)), "msort": _structural(_dim_is_batch(1, "dim", 0)),
    "topk": _structural(_dim_is_batch(2, "dim", -1)), "kthvalue": _reduction, "glu": _structural(_dim_is_batch(1, "dim", -1)),
    "normalize": _structural(_dim_is_batch(2, "dim", 1)), "gumbel_softmax": _structural(_dim_is_batch(4, "dim", -1)),
    "diff": _structural(_dim_is_batch(2, "dim", -1)),
    "flip": _structural(_d_flip), "fliplr": _structural(_dim_is_batch(9, "_", 1)), "flipud": _structural(_dim_is_batch(9, "_", 0)),
    "roll": _structural(_d_roll), "rot90": _structural(_d_rot90),
    "view_as_real": _structural(_d_view_as_real), "view_as_complex": _structural(_d_keep_leading(1)),
    "linear": _linear, "bilinear": _lost_if_tagged, "matmul": _matmul, "__matmul__": _matmul, "__rmatmul__": _matmul,
    "mm": _matmul, "bmm": _matmul, "mv": _matmul, "dot": _matmul, "vdot": _matmul, "inner": _lost_if_tagged,
    "addmm": _addmm, "baddbmm": _addmm, "addmv": _addmm, "addbmm": _addmm, "einsum": _einsum,
    "scaled_dot_product_attention": _sdpa,
    "embedding": _structural(_d_leading), "one_hot": _structural(_d_leading), "F.embedding": _structural(_d_leading),
    "embedding_bag": _embedding_bag,
    "layer_norm": _structural(_d_layer_norm), "rms_norm": _structural(_d_layer_norm),
    "group_norm": _structural(_d_group_norm), "batch_norm": _structural(_d_batch_norm),
    "instance_norm": _structural(_d_first_two), "local_response_norm": _structural(_d_first),
    "pad": _structural(_d_pad), "F.unfold": _structural(_d_first), "F.fold": _structural(_d_first),
    "cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _cat,
    "split": _split, "chunk": _split, "tensor_split": _split, "split_with_sizes": _split, "unbind": _split,
    "__getitem__": _getitem, "__setitem__": _setitem,
    "gather": _gather, "take_along_dim": _gather, "scatter": _gather, "scatter_add": _gather, "scatter_reduce": _gather,
    "scatter_": _gather, "scatter_add_": _gather, "scatter_reduce_": _gather, "index_add": _gather, "index_copy": _gather,
    "index_fill": _gather, "index_add_": _gather, "index_copy_": _gather, "index_fill_": _gather, "take": _take,
    "masked_select": _lost_if_tagged, "nonzero": _lost_if_tagged, "argwhere": _lost_if_tagged, "unique": _lost_if_tagged,
    "unique_consecutive": _lost_if_tagged, "bincount": _lost_if_tagged, "histc": _lost_if_tagged, "as_strided": _lost_if_tagged,
    "_pad_packed_sequence": _pad_packed, "_pack_padded_sequence": _pack_padded,
    "cosine_similarity": _cosine, "pairwise_distance": _cosine,
})
for _n in """conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc avg_pool1d avg_pool2d
avg_pool3d max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices max_pool3d_with_indices
adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d
adaptive_max_pool1d_with_indices adaptive_max_pool2d_with_indices lp_pool1d lp_pool2d lp_pool3d max_unpool1d
max_unpool2d max_unpool3d pixel_shuffle pixel_unshuffle channel_shuffle interpolate upsample upsample_nearest
upsample_bilinear grid_sample fractional_max_pool2d fractional_max_pool3d""".split():
    _RULES[_n] = _structural(_d_first)
for _n in """cross_entropy nll_loss binary_cross_entropy binary_cross_entropy_with_logits mse_loss l1_loss smooth_l1_loss
huber_loss kl_div poisson_nll_loss gaussian_nll_loss cosine_embedding_loss margin_ranking_loss hinge_embedding_loss
multilabel_margin_loss multilabel_soft_margin_loss multi_margin_loss soft_margin_loss triplet_margin_loss
triplet_margin_with_distance_loss ctc_loss""".split():
    _RULES[_n] = _loss


def _rule_for(func) -> Callable:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        key = "get:" + str(getattr(owner, "__name__", ""))
        return _RULES.get(key) or _skip
    if name is None:
        return _default
    module = getattr(func, "__module__", None) or ""
    if module == "torch.nn.functional" and "F." + name in _RULES:
        return _RULES["F." + name]
    if name == "embedding" and module != "torch.nn.functional":
        return _torch_embedding
    rule = _RULES.get(name)
    if rule is not None:
        return rule
    if name in _INPLACE_ALIASES:
        return partial(_inplace, _INPLACE_ALIASES[name])
    if name.endswith("_") and not name.startswith("_"):
        base = _RULES.get(name[:-1])
        if base is _broadcast:
            return partial(_inplace, name[:-1])
        if name in ("unsqueeze_", "squeeze_", "transpose_", "t_", "swapaxes_", "swapdims_"):
            dimfn = {"unsqueeze_": _d_unsqueeze, "squeeze_": _d_squeeze, "t_": _d_t}.get(name, _d_transpose)
            return _structural(dimfn, inplace=True)
    return _default


def _inplace(base: str, tr, func, args, kwargs):
    return _broadcast(tr, func, args, kwargs, inplace=True, name=base + "_")


def _torch_embedding(tr, func, args, kwargs):  # torch.embedding(weight, indices, ...)
    weight, indices = args[0], args[1]
    tag = tr.get(indices)
    out = tr.run(func, args, kwargs)
    wtag = tr.get(weight)
    if wtag is not None and type(wtag) is not tuple:
        tr.put(out, tr.lost("embedding of weights derived from the batch"))
    elif tag is not None:
        tr.put(out, tag)
    elif wtag is not None:
        tr.put(out, wtag)
    return out


_RULES["copy_"] = partial(_inplace, "copy")
