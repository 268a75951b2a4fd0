"""Matmuls over quantized frozen weights: bitsandbytes' operators, as QLoRA's base layers call them.

Keyed by the custom operator's qualified name (``ns::name``). Each output row is a function of the
same row of the activation ``A`` and of shared tensors (the packed weight, its scales, the bias),
like ``linear``, so ``A``'s batch dim carries over unless it is the contracted (last) one. The one
exception is LLM.int8()'s outlier decomposition: with a threshold above 0, ``int8_vectorwise_quant``
picks the outlier columns from every row of the batch and zeroes those columns in all rows, so a
sample's output depends on the other samples' activations; its outputs are ``Lost``. On the CPU,
bitsandbytes trains 8-bit layers by dequantizing the weight and calling ``linear`` (the rule of
``linalg.py``), so these operators are met there only with the layer in eval mode.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Sequence

from torch import Tensor

from dptorch.grad_sample.tracking.args import Tracker, arg, op_name, tensors_of
from dptorch.grad_sample.tracking.rules.opaque import lost_if_tagged
from dptorch.grad_sample.tracking.tags import DIM, KEEP
from dptorch.grad_sample.tracking.writes import derived

OUTLIER_COUPLING = (
    "LLM.int8()'s outlier threshold, which picks outlier columns from the whole batch's activations (a "
    "sample's output then depends on the others'): load the model with BitsAndBytesConfig(load_in_8bit=True, "
    "llm_int8_threshold=0.0), or use 4-bit (load_in_4bit=True)"
)


def _row_tag(tr: Tracker, func, a: Tensor, tag: Any, rows_only: bool) -> Any:
    """The output tag of a row-wise operation on ``a`` (tagged ``tag``): ``rows_only``: ``a`` must be
    ``(rows, features)`` with the batch along the rows (the operator reads dim 1 whole)."""
    if type(tag) is not int:
        return tag  # None, an origin call's tuple, or Lost: carried over as they are
    d = tag & DIM
    if d == a.ndim - 1:
        return tr.lost(f"{op_name(func)} contracts the batch dimension", tag)
    if rows_only and (a.ndim != 2 or d != 0):
        return tr.lost(f"{op_name(func)} on a {a.ndim}-d input batched along dim {d} (rows expected)", tag)
    return (tag & KEEP) | d


def _rowwise(batched: Sequence[str], rows_only: bool = False) -> Callable:
    """The rule of an operator whose output rows are each one row of its first argument ``A``;
    ``batched``: the names of further arguments that may hold one entry per row of ``A``, batched as
    ``A`` is (row scales); every other tensor argument must be shared by the samples."""

    def rule(tr: Tracker, func, args, kwargs):
        a = arg(args, kwargs, 0, "A")
        tag = tr.get(a)
        schema = getattr(func, "_schema", None) or getattr(getattr(func, "default", None), "_schema", None)
        names = {("a", i): s.name for i, s in enumerate(schema.arguments if schema is not None else ())}
        others = []
        for where, t in tensors_of(args, kwargs):
            if t is a:
                continue
            g = tr.get(t)
            name = where[1] if where[0] == "k" else names.get(where)
            if g is None or (name in batched and type(g) is int and g == tag and t.ndim == 1 and rows_only
                             and t.shape[0] == a.shape[0]):
                continue
            others.append(g)
        out = tr.run(func, args, kwargs)
        if others:
            new = tr.lost_from(f"{op_name(func)} with a weight or scale derived from the batch or from another "
                               "layer's output", [tag, *others])
        else:
            new = _row_tag(tr, func, a, tag, rows_only)
        tr.put_all(out, new)
        return out

    return rule


_rowwise_quant = _rowwise((), rows_only=True)


def _int8_vectorwise_quant(tr: Tracker, func, args, kwargs):
    """``(A, threshold) -> (int8 rows, each row's absmax, outlier columns)``: row by row at threshold 0."""
    threshold = arg(args, kwargs, 1, "threshold", 0.0)
    tag = tr.get(arg(args, kwargs, 0, "A"))
    if threshold > 0.0 and derived(tag):
        out = tr.run(func, args, kwargs)
        tr.put_all(out, tr.lost_from(OUTLIER_COUPLING, [tag]))
        return out
    return _rowwise_quant(tr, func, args, kwargs)


RULES: Dict[str, Callable] = {
    # A (..., K) @ dequantized(B) (N, K)^T + bias: absmax, the nested scales and the bias are the weight's
    "bitsandbytes::gemm_4bit": _rowwise(()),
    "bitsandbytes::int8_vectorwise_quant": _int8_vectorwise_quant,
    # int8 rows (n, K) @ int8 weight (N, K)^T, scaled by each row's and each weight row's absmax
    "bitsandbytes::int8_scaled_mm": _rowwise(("row_stats",), rows_only=True),
    # the int8 matmul plus the outlier columns in 16 bits: met only behind a threshold above 0
    "bitsandbytes::int8_mixed_scaled_mm": partial(lost_if_tagged, reason=OUTLIER_COUPLING),
}
