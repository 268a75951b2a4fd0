"""Rows of the per-sample results by privacy unit: a unit's rows zeroed, summed or placed side by side.

Units named in ``dropped`` (their gradient is not finite) contribute exactly zero: their rows of
every operand are zeroed by ``torch.where`` (``zero_rows``) before any product, since ``0 * inf`` is
NaN. Privacy units that span several rows (``set_privacy_units``) are numbered in ascending id order
(``unit_index``); their rows are summed (``sum_rows_by_unit``) or, for a token-wise layer's norms,
placed side by side along the token dimension (``group_rows_by_unit``).
"""

from __future__ import annotations

from typing import Optional

import torch

from dptorch.grad_sample.errors import PerSampleGradientError


def zero_rows(x: torch.Tensor, dropped: Optional[torch.Tensor]) -> torch.Tensor:
    """``x`` with the rows of the ``dropped`` units (a bool mask over dim 0) exactly 0.

    By ``torch.where``, not by a factor of 0: an inf or NaN row times 0 is NaN, and in a matmul over
    the batch it would reach every unit's sum. ``dropped=None``: ``x`` itself.
    """
    if dropped is None:
        return x
    mask = dropped.to(x.device).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, x.new_zeros(()), x)


def unit_index(unit_ids: torch.Tensor, rows: int, name: str = "") -> torch.Tensor:
    """Map arbitrary unit ids of ``rows`` rows to 0..U-1 in ascending id order."""
    if unit_ids.shape[0] != rows:
        raise PerSampleGradientError(
            f"privacy units name {unit_ids.shape[0]} rows but the batch of {name or 'a parameter'} has "
            f"{rows}; call set_privacy_units with one id per row of every batch"
        )
    return torch.unique(unit_ids, return_inverse=True)[1]


def sum_rows_by_unit(grad_sample: torch.Tensor, unit_ids: torch.Tensor, name: str = "") -> torch.Tensor:
    """Sum the rows of ``grad_sample`` that share a unit id; one row per unit, ids ascending."""
    units = unit_index(unit_ids.to(grad_sample.device), grad_sample.shape[0], name)
    num_units = int(units.max()) + 1 if units.numel() else 0
    return grad_sample.new_zeros((num_units, *grad_sample.shape[1:])).index_add_(0, units, grad_sample)


def group_rows_by_unit(x: torch.Tensor, unit_ids: torch.Tensor) -> torch.Tensor:
    """The rows of each unit placed side by side along the token dimension.

    Float tensors are ``(B, *middle, F)`` features and become ``(U, R * prod(middle), F)``;
    integer tensors (token ids) are ``(B, *rest)`` and become ``(U, R * prod(rest))``. Short units
    are padded with zeros, which add nothing to a token-wise layer's gradient (their backprops
    are zero).
    """
    units = unit_index(unit_ids.to(x.device), x.shape[0])
    num_units = int(units.max()) + 1 if units.numel() else 0
    counts = torch.bincount(units, minlength=num_units)
    width = int(counts.max()) if counts.numel() else 0
    order = torch.argsort(units, stable=True)
    sorted_units = units[order]
    position = torch.arange(len(units), device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_units]
    rows = x.reshape(x.shape[0], -1, x.shape[-1]) if x.is_floating_point() else x.reshape(x.shape[0], -1)
    grouped = rows.new_zeros((num_units, width, *rows.shape[1:]))
    grouped[sorted_units, position] = rows[order]
    return grouped.reshape(num_units, width * rows.shape[1], *rows.shape[2:])
