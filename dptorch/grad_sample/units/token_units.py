"""Token-level privacy units: several examples packed into one batch row, each its own unit.

``ids[b, t]`` names the unit of token ``t`` of row ``b`` (any integer >= 0; -1: a pad token that
belongs to no unit). A unit's tokens must stay in one row. Per-unit results have one row per
unit, in ascending id order, like row units (``GradSampleHooks.set_privacy_units``).

The pure functions here derive the ids from what packing collators emit (``position_ids`` that
restart at 0, per-row sequence lengths, ``cu_seq_lens``), lay a token-wise layer's tensors out one
unit per row (``TokenUnits.group``), and check that an attention mask keeps units apart
(``crossing_attention``).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

_UNKNOWN = object()


class TokenUnits:
    """The units of the tokens of a ``(B, T)`` batch, and the ``(U, L)`` layout that holds one unit per row."""

    def __init__(self, ids: torch.Tensor) -> None:
        ids = torch.as_tensor(ids)
        if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(
                f"token privacy units need one integer id per token, shape (batch, tokens); got {ids.dtype} of shape "
                f"{tuple(ids.shape)}"
            )
        self.ids = ids.long()
        flat = self.ids.flatten()
        kept = flat >= 0
        values, index = torch.unique(flat[kept], return_inverse=True)
        positions = torch.nonzero(kept).flatten()
        rows = torch.div(positions, ids.shape[1], rounding_mode="floor")
        self.num_units = int(values.numel())
        # a unit's tokens share one row: each token's row is the row some token of its unit wrote
        if self.num_units and bool((rows.new_empty(self.num_units).scatter_(0, index, rows)[index] != rows).any()):
            raise ValueError(
                "a token privacy unit spans several batch rows; keep each unit's tokens in one row (a packing collator "
                "does), or give the rows one unit id each with a 1-D tensor"
            )
        self.index = torch.full_like(flat, -1)
        self.index[kept] = index  # each token's unit, 0..U-1 (ids ascending), -1 for pads
        self.counts = torch.bincount(index, minlength=self.num_units)  # (U,) tokens per unit
        self.width = int(self.counts.max()) if self.num_units else 0
        order = torch.argsort(index, stable=True)
        self.source = positions[order]  # flat token positions, unit by unit, in order
        self.unit = index[order]  # their units
        self.offsets = torch.cumsum(self.counts, 0) - self.counts  # (U,) each unit's first place in ``source``
        self.slot = torch.arange(order.numel(), device=ids.device) - self.offsets[self.unit]  # place in its unit
        self._spans: Any = _UNKNOWN
        self._dest: Optional[torch.Tensor] = None  # each token's flat place in the (U, L) layout

    @property
    def shape(self) -> torch.Size:
        return self.ids.shape

    def spans(self) -> Optional[list]:
        """``[(start, stop)]`` per unit when each unit's tokens are the flat positions ``start..stop-1`` of the
        ``(B, T)`` batch (what packing collators emit: each example a run of one row); None otherwise."""
        if self._spans is _UNKNOWN:
            first = self.source[self.offsets]  # each unit's first position
            runs = bool((self.source == first[self.unit] + self.slot).all())
            self._spans = [(s, s + n) for s, n in zip(first.tolist(), self.counts.tolist())] if runs else None
        return self._spans

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(B, T, *rest)`` as ``(U, L, *rest)``: unit ``u``'s tokens in row ``u``, in order,
        zeros after them (zeros add nothing to a token-wise layer's gradient: their output gradient is zero)."""
        if tuple(x.shape[:2]) != tuple(self.ids.shape):
            raise ValueError(
                f"a tensor of shape {tuple(x.shape)} does not have the (batch, tokens) = {tuple(self.ids.shape)} leading "
                "dims the token privacy units name"
            )
        if self._dest is None:
            self._dest = self.unit * self.width + self.slot
        return scatter_rows(x.reshape(-1, *x.shape[2:]), self.source, self._dest, (self.num_units, self.width))

    def same_unit(self) -> torch.Tensor:
        """``(B, T, T)`` bool: query token ``i`` and key token ``j`` of a row are in one unit (pad queries: any key)."""
        ids = self.ids
        return (ids[:, :, None] == ids[:, None, :]) | (ids[:, :, None] < 0)


def scatter_rows(rows: torch.Tensor, source: torch.Tensor, dest: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A zero tensor of shape ``(*shape, *rows.shape[1:])`` whose flat row ``dest[i]`` is ``rows[source[i]]``."""
    if source.device != rows.device:
        source, dest = source.to(rows.device), dest.to(rows.device)
    out = rows.new_zeros((math.prod(shape), *rows.shape[1:]))
    out.index_copy_(0, dest, rows.index_select(0, source))
    return out.view(*shape, *rows.shape[1:])


def units_from_position_ids(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Unit ids ``(B, T)`` from packed ``position_ids``: a new example starts wherever the position does not
    follow the previous one by 1 (as transformers reads packed sequences); masked-out tokens get -1. Ids count
    from 0 in row-major order."""
    position_ids = torch.as_tensor(position_ids)
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    ids = torch.cumsum(starts.flatten().long(), 0).view_as(position_ids) - 1
    if attention_mask is not None:
        kept = torch.as_tensor(attention_mask).to(ids.device).bool()
        ids = torch.where(kept, ids, ids.new_full((), -1))
        ids[kept] = torch.unique(ids[kept], return_inverse=True)[1]  # numbered 0.. again, without the masked spans
    return ids


def units_from_seq_lengths(seq_lengths: Sequence[Sequence[int]], tokens: int) -> torch.Tensor:
    """Unit ids ``(B, tokens)`` from each row's example lengths (TRL's ``seq_lengths``); tokens past them get -1."""
    rows = []
    next_id = 0
    for lengths in seq_lengths:
        lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        if any(n < 0 for n in lengths) or sum(lengths) > tokens:
            raise ValueError(f"sequence lengths {lengths} do not fit a row of {tokens} tokens")
        row = torch.full((tokens,), -1, dtype=torch.long)
        row[: sum(lengths)] = torch.repeat_interleave(torch.arange(next_id, next_id + len(lengths)), torch.tensor(lengths, dtype=torch.long))
        next_id += len(lengths)
        rows.append(row)
    return torch.stack(rows) if rows else torch.zeros((0, tokens), dtype=torch.long)


def units_from_cu_seq_lens(cu_seq_lens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Unit ids ``(1, tokens)`` from cumulative lengths ``[0, n1, n1 + n2, ...]`` of one flattened row."""
    cu = torch.as_tensor(cu_seq_lens).flatten().long()
    if cu.numel() == 0 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seq_lens must start at 0 and never decrease; got {cu.tolist()}")
    return units_from_seq_lengths([(cu[1:] - cu[:-1]).tolist()], tokens)


def crossing_attention(units: TokenUnits, mask: Optional[torch.Tensor], is_causal: bool) -> Optional[str]:
    """Why attention with ``mask`` (``(.., T, T)``, broadcast over batch and heads; bool: may attend; float:
    added to the scores, where only -inf or at most half of the dtype's lowest value blocks) or ``is_causal``
    lets a token of one unit see a token of another; None when it does not."""
    same = units.same_unit()
    size = same.shape[-1]
    if mask is None:
        allowed = torch.ones((size, size), dtype=torch.bool, device=same.device)
    elif mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask > torch.finfo(mask.dtype).min / 2
    else:
        return f"an attention mask of dtype {mask.dtype}"
    if is_causal:
        allowed = allowed & torch.ones((size, size), dtype=torch.bool, device=same.device).tril()
    if allowed.dim() > 4 or allowed.shape[-2:] != (size, size):
        return f"an attention mask of shape {tuple(allowed.shape)} for {size} tokens"
    while allowed.dim() < 4:
        allowed = allowed[None]
    if allowed.shape[0] not in (1, same.shape[0]):
        return f"an attention mask of shape {tuple(allowed.shape)} for a batch of {same.shape[0]} rows"
    allowed = allowed.to(same.device).any(dim=1)  # a key any head may attend
    crossing = allowed & ~same
    if not bool(crossing.any()):
        return None
    b, i, j = (int(v) for v in torch.nonzero(crossing)[0])
    return (f"row {b}: token {i} (unit {int(units.ids[b, i])}) may attend to token {j} (unit {int(units.ids[b, j])})"
            + (" (a causal mask over the whole row)" if mask is None else ""))
