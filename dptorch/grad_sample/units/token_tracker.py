"""The token tracker: follows the token dimension of packed rows, so that units of tokens stay apart.

With token privacy units (several examples packed in one row, ``token_units.py``) the batch
tracker's question is asked again along the tokens: does position ``t`` of a tensor derive from
position ``t`` of the root's ``(B, T)`` inputs only? ``TokenTracker`` is a ``BatchTracker`` of
``n = T`` whose root inputs are tagged along dim 1, so every rule of ``rules/`` answers it
unchanged: an operation that mixes positions (a sum or a convolution over time, a shift, a
matmul contracting the tokens, eager attention) loses the tag. One operation is allowed to mix:
``scaled_dot_product_attention`` whose mask (or ``is_causal``) lets no token of a unit attend to
a token of another; its output keeps the tag, which then means "depends on its own unit's
positions only", a property every rule preserves. Trainable layers are checked by the controller
(``token_call``): each must act on every token on its own, fed a tensor that keeps the tag.

A mixture-of-experts block flattens its ``(B, T, H)`` input to ``(B * T, H)`` rows of tokens, routes
them and unflattens the result. That one reshape, and its exact inverse, are followed here
(``ROWS_TOKENS``: the dim holds the rows' tokens one row after the other); any other reshape of such a
tensor loses the tag, and every other rule treats the flattened dim as the tracked one (mixing along
it loses the tag).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from torch import Tensor, nn

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.units.token_units import TokenUnits, crossing_attention
from dptorch.grad_sample.tracking.args import arg, op_name
from dptorch.grad_sample.tracking.mode import BatchTracker
from dptorch.grad_sample.tracking.registry import rule_of
from dptorch.grad_sample.tracking.rules.linalg import RULES as LINALG
from dptorch.grad_sample.tracking.rules.structural import RULES as STRUCTURAL
from dptorch.grad_sample.tracking.tags import DIM, INNER, ROWS_TOKENS, WEAK, Lost

_ATTENTION = LINALG["scaled_dot_product_attention"]
_RESHAPE = STRUCTURAL["reshape"]
TOKEN_DIM = 1
_FIX = ("Packed examples must not see each other: use attn_implementation='sdpa' with position_ids that restart at 0 "
        "for every example and no attention_mask (transformers then builds a block-diagonal mask), or pass that "
        "mask yourself.")


class TokenTracker(BatchTracker):
    """Follows the token dim of the ``(B, T)`` batch that ``units`` describe; ``batch`` is the batch tracker."""

    def __init__(self, units: TokenUnits, batch: BatchTracker) -> None:
        super().__init__(units.shape[1], skip=batch.skip, quiet=batch.quiet)
        self.units = units
        self.batch = batch
        self._masks: Dict[tuple, tuple] = {}  # (mask id, version, causal) -> (the mask, the crossing found or None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not (self.paused or self.done):
            rule = rule_of(func)
            if rule is _ATTENTION:
                return self._attention(func, args, kwargs or {})
            if rule is _RESHAPE and args and isinstance(args[0], Tensor) and self._flattens(self.get(args[0])):
                return self._reshape(func, args, kwargs or {})
        return super().__torch_function__(func, types, args, kwargs)

    def keeps_tokens(self, t: Tensor) -> bool:
        """Whether ``t``'s dims 0 and 1 are the packed batch's rows and tokens (each token its unit's data)."""
        g = self.get(t)
        return (type(g) is int and g & DIM == TOKEN_DIM and not g & ~(DIM | WEAK) and self.rows_kept(t)
                and tuple(t.shape[:2]) == tuple(self.units.shape))

    def flat_tokens(self, t: Tensor) -> bool:
        """Whether ``t``'s dim 0 is the packed batch's rows and tokens flattened, row-major (``ROWS_TOKENS``)."""
        g = self.get(t)
        rows, tokens = self.units.shape
        if not (type(g) is int and g & ~WEAK == ROWS_TOKENS and t.dim() and t.shape[0] == rows * tokens):
            return False
        tag = self.batch.get(t)
        return rows <= 1 or (type(tag) is int and tag == tokens * INNER)

    def layout(self, t: Tensor) -> Optional[str]:
        """"tokens" (``keeps_tokens``), "flat" (``flat_tokens``) or None: neither."""
        return "tokens" if self.keeps_tokens(t) else "flat" if self.flat_tokens(t) else None

    def _flattens(self, tag: Any) -> bool:
        return type(tag) is int and (tag & ~WEAK in (TOKEN_DIM, ROWS_TOKENS))

    def _reshape(self, func, args: tuple, kwargs: dict) -> Any:
        """Flattening ``(B, T, ...)`` to ``(B * T, ...)``, its inverse, and a reshape that keeps the shape, of
        the packed tokens; any other reshape of flattened tokens loses the tag (of unflattened ones: the rule's)."""
        x = args[0]
        layout = self.layout(x)
        if layout != "flat":
            out = super().__torch_function__(func, (), args, kwargs)
            rows, tokens = self.units.shape
            if layout == "tokens" and isinstance(out, Tensor) and tuple(out.shape) == (rows * tokens, *x.shape[2:]):
                self.put(out, ROWS_TOKENS)
            return out
        out = self.run(func, args, kwargs)
        shape, new = tuple(x.shape), tuple(out.shape)
        if new == (*self.units.shape, *shape[1:]):
            self.put(out, TOKEN_DIM)
        elif new == shape:
            self.put(out, ROWS_TOKENS)
        else:
            self.put(out, Lost(f"{op_name(func)} of the packed tokens flattened with their rows, other than its inverse"))
        return out

    def rows_kept(self, t: Tensor) -> bool:
        """Whether row ``b`` of ``t`` is row ``b`` of the batch (the batch tracker says so, or there is one row)."""
        if t.dim() == 0 or t.shape[0] != self.units.shape[0]:
            return False
        tag = self.batch.get(t)
        return self.units.shape[0] <= 1 or (type(tag) is int and tag == 0)

    def _attention(self, func, args: tuple, kwargs: dict) -> Any:
        q, k, v = (arg(args, kwargs, i, name) for i, name in enumerate(("query", "key", "value")))
        mask = arg(args, kwargs, 3, "attn_mask")
        causal = bool(arg(args, kwargs, 5, "is_causal", False))
        tags = [self.get(t) for t in (q, k, v)]
        if all(g is None for g in tags) and (not isinstance(mask, Tensor) or self.get(mask) is None):
            return self.run(func, args, kwargs)
        out = self.run(func, args, kwargs)
        aligned = all(type(g) is int and g & ~WEAK == t.ndim - 2 and self.rows_kept(t) for g, t in zip(tags, (q, k, v)))
        if not aligned or q.shape[-2] != k.shape[-2]:
            reason = next((g.reason for g in tags if type(g) is Lost), "attention over tensors whose token positions "
                          "are not the packed batch's")
            self.put(out, Lost(reason))
            return out
        if isinstance(mask, Tensor) and mask.requires_grad:
            raise PerSampleGradientError(f"attention with a trainable mask couples packed examples. {_FIX}")
        problem = self._crossing(mask if isinstance(mask, Tensor) else None, causal)
        if problem is not None:
            raise PerSampleGradientError(
                f"scaled_dot_product_attention lets one packed example attend to another ({problem}): their "
                f"gradients would be coupled, and each could not be clipped on its own. {_FIX} Nothing was updated."
            )
        self.put(out, tags[0])
        return out

    def _crossing(self, mask: Optional[Tensor], causal: bool) -> Optional[str]:
        key = (id(mask), getattr(mask, "_version", 0), causal)
        held = self._masks.get(key)
        if held is None or held[0] is not mask:  # the mask is held, so its id names no other tensor
            paused, self.batch.paused = self.batch.paused, True  # our own reads of the mask: not the model's
            try:
                held = self._masks[key] = (mask, crossing_attention(self.units, mask, causal))
            finally:
                self.batch.paused = paused
        return held[1]


def token_call(tracker: TokenTracker, name: str, module: nn.Module, token_wise: bool,
               tensors: Sequence[Tensor]) -> Tuple[Any, bool]:
    """The token tag of a trainable layer call's output, and whether its tensors hold the tokens flattened
    with their rows (``(B * T, ...)``); refused unless the layer acts on each token on its own and every tensor
    argument keeps the packed batch's rows and token positions, all in one layout (dims 0 and 1, or dim 0)."""
    kind = type(module).__name__
    if not token_wise:
        raise PerSampleGradientError(
            f"{name} ({kind}) mixes token positions through its parameters (or has no per-token rule), so with "
            "several examples packed in one row their gradients cannot be told apart. Freeze it, or give every "
            "example its own row (no packing)."
        )
    tag, first = None, None
    for t in tensors:
        g, layout = tracker.get(t), tracker.layout(t)
        if layout is not None and first in (None, layout):
            if first is None:
                tag, first = g, layout
            continue
        why = (g.reason if type(g) is Lost else "its dims 0 and 1 are not the packed batch's rows and tokens"
               if layout is None else "its tokens are laid out unlike the call's other inputs")
        raise PerSampleGradientError(
            f"{name} ({kind}) is called on a tensor of shape {tuple(t.shape)} whose token positions do not each hold "
            f"one packed example's data ({why}), so per-example gradients of its parameters are not defined. "
            f"{_FIX}"
        )
    return tag, first == "flat"


def refuse(what: str) -> PerSampleGradientError:
    """The refusal of a path the token units do not cover."""
    return PerSampleGradientError(
        f"{what}: with several examples packed in one row (token privacy units) its gradient cannot be split per "
        "example. Freeze it, or train without packing."
    )
