"""Origin calls: captured layer calls whose inputs carry no batch dimension, and their meetings.

Such a call's output is shared by the samples (T5's relative attention bias of bucket ids
``(T, T)``, nanoGPT's ``wpe(arange(T))``). Where it (or a tensor derived only from it) meets
batched tensors (broadcast in ``scores + bias``, ``tok + pos``, an ``attn_mask``), the tracker
replaces it by its expansion along the batch dim behind an identity tap, so that each sample's
gradient of it is kept apart in backward and mapped back to the layer's output (through the
operations in between, with one batched vector-Jacobian product). Each layer call then gets
exact per-sample gradients, whatever ``T`` and ``n``.

Where the batch is merged with an inner dim (Swin's ``(B * windows, ...)``, DeBERTa-v2's
``(B * heads, ...)``), a meeting either broadcasts the shared tensor over the merged dim (each
sample's gradient is the sum over its group of rows) or pairs its rows with the result's (each
sample keeps its own group of rows). A layer whose arguments carry the batch but whose outputs do
not (BART's positions read from ``input_ids``' length) is such a call too.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tap import own_pass
from dptorch.grad_sample.value_checks import require

class OriginCall:
    """A captured layer call whose inputs carry no batch dimension.

    Its output is shared by the samples; the per-sample gradients of that output are gathered
    where it (or a tensor derived only from it) meets batched tensors: ``dense`` holds
    ``(n, *output.shape)`` gradients; ``rows`` holds ``(grad, dim)`` pairs of a use whose
    ``dim`` pairs row ``i`` with sample ``i`` (the output already had ``n`` rows there).
    """

    __slots__ = ("name", "n", "read", "shape", "output", "edge", "dense", "rows", "__weakref__")

    def __init__(self, name: str, n: int, read: bool = False) -> None:
        self.name = name
        self.n = n
        self.read = read  # it stands for a parameter read outside its module's call (reads.py), not a layer call
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


def rows_to_dense(rows: Tensor, dim: int, n: int, group: int = 1) -> Tensor:
    """``(n, *rows.shape)`` where sample ``i`` keeps only its rows (along ``dim``) of ``rows``: row
    ``i``, or with ``group`` rows per sample, rows ``i * group`` to ``(i + 1) * group - 1``."""
    dense = rows.new_zeros((n, *rows.shape))
    index = torch.arange(rows.shape[dim], device=rows.device)
    dense.movedim(dim + 1, 1)[index // group, index] = rows.movedim(dim, 0)
    return dense


def meeting_backward(use: Optional[Tensor], shape: Tuple[int, ...], direct: Tuple[OriginCall, ...],
                      chained: Tuple[OriginCall, ...], edges: tuple, broadcast: bool, out_dim: int, group: int,
                      lead: int, n: int, skip: Callable[[], bool], quiet: Callable[[], Any],
                      saved: Tuple[Tensor, ...], grads: Tuple[Tensor, ...]) -> None:
    """Per-sample gradients of an origin-derived tensor (``use``, of ``shape``) where it met the batch
    along ``out_dim`` (``group`` rows per sample there)."""
    grad = grads[0]
    if grad is None or skip():
        return
    if broadcast:  # the use was expanded along out_dim: row i of grad is sample i's (rows of group i)
        rows = grad.movedim(out_dim, 0)
        if group > 1:
            rows = rows.unflatten(0, (n, group)).sum(1)
        per_sample = rows.reshape(n, *shape)
        for origin in direct:
            origin.add_dense(per_sample)
    elif group > 1:  # the use already had n groups of rows along out_dim, paired with the samples
        per_sample = rows_to_dense(grad.reshape(shape), out_dim - lead, n, group)
        for origin in direct:
            origin.add_dense(per_sample)
    else:  # the use already had n rows along out_dim, paired with the samples
        rows, dim = grad.reshape(shape), out_dim - lead
        for origin in direct:
            origin.rows.append((rows, dim))
        per_sample = rows_to_dense(rows, dim, n) if chained else None
    if chained:  # through the operations between each origin's output and this use
        with quiet(), own_pass():
            found = torch.autograd.grad([use], list(edges), [per_sample], retain_graph=True, allow_unused=True,
                                        is_grads_batched=True)
        for origin, g in zip(chained, found):
            if g is not None:
                origin.add_dense(g)


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
    """Refuse the origin's per-sample gradients unless they add up to ``total`` (within 1e-3 of its largest entry,
    2e-2 below float32); a non-finite total is not checked. A value check (``value_checks``): read after the replay
    in a captured step."""
    if not total.is_floating_point() or not total.numel():
        return
    scale = total.abs().max().double()
    tol = (1e-3 if total.dtype in (torch.float32, torch.float64) else 2e-2) * scale + 1e-7
    within = (got.to(total.dtype) - total).abs().max().double() <= tol
    require(~torch.isfinite(total).all() | within, lambda: _unseen_path_error(origin))


def _unseen_path_error(origin: OriginCall) -> PerSampleGradientError:
    if origin.read:
        return PerSampleGradientError(
            f"{origin.name}: the parameter is read outside its module's call and fed, without a batch, to layers, "
            "and part of its gradient reached it by a path where the samples could not be told apart (it also met "
            "the batch directly, or through an operation the batch tracker does not follow). Call its module "
            "instead of reading its weight, or freeze it."
        )
    return PerSampleGradientError(
        f"{origin.name} is called on inputs that carry no batch dimension (its output is shared by the samples), "
        "and part of its output's gradient reached it by a path where the samples could not be told apart (the "
        "output, or a tensor derived from it, met the batch outside the model's forward, in reentrant activation "
        "checkpointing, or through an operation the batch tracker does not follow). Give the layer inputs with a "
        "leading batch dimension (e.g. positions[None].expand(batch_size, -1)), or freeze its parameters."
    )
