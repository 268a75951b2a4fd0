"""Checks of the clipping arguments (mode and bound), run before anything is attached."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

from dptorch.accounting.validation import is_number
from dptorch.clipping.factors import CLIPPING_MODES, FLAT_MODES

MaxGradNorm = Union[float, Sequence[float]]


def check_clipping(
    clipping: str,
    max_grad_norm: MaxGradNorm,
    params: Optional[Sequence[Any]] = None,
    names: Optional[Sequence[str]] = None,
) -> None:
    """Refuse a clipping mode or bound the optimizer could not use, before anything is attached.

    ``params`` (the optimizer's trainable parameters, in order) lets a per-layer list be checked
    for one threshold per parameter; ``names`` are their names for the message.
    """
    if clipping not in CLIPPING_MODES:
        raise ValueError(f"clipping must be one of {CLIPPING_MODES}, got {clipping!r}")
    if is_number(max_grad_norm):
        if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        return
    if clipping in FLAT_MODES:
        raise ValueError(f"{clipping} clipping takes one max_grad_norm (a float); a list is for clipping='per_layer'")
    try:
        thresholds = list(max_grad_norm)
    except TypeError:
        raise ValueError(f"max_grad_norm must be a number or a list of numbers, got {max_grad_norm!r}") from None
    bad = [c for c in thresholds if not is_number(c) or not (c > 0 and math.isfinite(c))]
    if bad or not thresholds:
        raise ValueError(f"per-layer max_grad_norm must be a non-empty list of numbers > 0, got {thresholds!r}")
    if params is not None and len(thresholds) != len(params):
        listed = ""
        if names:
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            listed = f" ({shown})"
        raise ValueError(
            f"clipping='per_layer' needs one max_grad_norm per trainable parameter of the optimizer, in order: got "
            f"{len(thresholds)} thresholds for {len(params)} parameters{listed}. Give {len(params)} thresholds, or "
            "one float to split evenly across them"
        )
