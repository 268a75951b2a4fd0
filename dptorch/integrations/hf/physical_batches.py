"""``auto_find_batch_size`` in the private Trainer: the largest physical batch that fits, sampling untouched.

In DP-SGD the logical batch is the Poisson draw: its rate ``q`` (from ``per_device_train_batch_size *
gradient_accumulation_steps``), the steps and the noise are what the accountant sees. How a drawn micro-batch
is cut into forward and backward passes is free, as long as each privacy unit lies whole in one pass (the DP
optimizer clips after every backward pass: a unit split over two would be clipped twice). transformers'
``auto_find_batch_size`` instead restarts training with half the per-device batch after an out-of-memory
error, which would halve ``q`` and re-run steps already taken and accounted.

:class:`PhysicalBatchSearch` keeps the draws as they are: a micro-batch runs whole until a pass raises an
out-of-memory error (what ``accelerate.utils.should_reduce_batch_size`` calls one). The failed pass's partial
capture is discarded (:meth:`GradSampleHooks.discard_failed_pass`; nothing reached the DP optimizer), the cap
on units per pass is halved, and the same units run again in smaller passes; the cap holds for the rest of
the run. Units that already passed are never run again, so every drawn unit is clipped and added exactly once.
The optimizer steps, the noise and the accounting do not see the difference. An error from the DP optimizer's
clipping at the end of a pass, or a unit that does not fit alone, stops training (not retried).

One process only: on several, a rank's extra passes would unpair the collectives every rank runs per pass.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional

import torch
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size
from transformers.utils import logging

logger = logging.get_logger(__name__)

#: A function that runs one pass (forward and backward) of a batch whose rows are the given units' rows, and
#: returns its loss: ``run(batch, unit_ids_of_its_rows)``.
RunPass = Callable[[Dict[str, Any], Optional[torch.Tensor]], torch.Tensor]


class PhysicalBatchSearch:
    """The cap on units per pass (``None``: a whole micro-batch), lowered on out-of-memory errors."""

    def __init__(self, sample_rate: float, expected_batch_size: float) -> None:
        self.cap: Optional[int] = None
        self.sample_rate = sample_rate
        self.expected_batch_size = expected_batch_size

    def run(self, batch: Dict[str, Any], unit_ids: Optional[torch.Tensor], run_pass: RunPass,
            discard_failed_pass: Callable[[], bool]) -> torch.Tensor:
        """Run ``batch`` (one micro-batch, ``unit_ids`` one per row or None: a unit per row) in passes of at most
        ``cap`` units; returns the sum of the passes' losses."""
        rows = _rows(batch)
        pending = unit_rows(unit_ids, rows)
        total: Optional[torch.Tensor] = None
        while pending:
            take = pending[: self.cap or len(pending)]
            index = torch.cat(take)
            whole = len(take) == len(pending) and self.cap is None
            part = batch if whole else select_rows(batch, index, rows)
            units = None if unit_ids is None else unit_ids[index]
            failed = False
            try:
                loss = run_pass(part, units)
            except Exception as error:  # noqa: BLE001 (only out-of-memory errors are retried)
                if not should_reduce_batch_size(error):
                    raise
                if not discard_failed_pass():
                    raise RuntimeError(
                        "auto_find_batch_size: the DP optimizer's clipping ran out of memory at the end of a pass, "
                        "after it may have added part of it; the pass cannot run again. Lower "
                        "per_device_train_batch_size"
                    ) from error
                if len(take) == 1:
                    raise RuntimeError(
                        "auto_find_batch_size: one privacy unit alone does not fit in memory (a unit is never split "
                        "over passes: each is clipped once). Shorten the sequences, or give a unit fewer rows "
                        "(privacy_unit_column)"
                    ) from error
                failed = True
            if failed:  # outside the handler: the error's frames (and their tensors) are gone
                clear_device_cache(garbage_collection=True)
                self.cap = max(1, len(take) // 2)
                logger.warning(
                    "auto_find_batch_size: out of memory with %d privacy units in one forward and backward pass; "
                    "from now on at most %d units run per pass. The Poisson draws (sample rate %.4g, %.4g units "
                    "expected per logical batch), the steps, the noise and epsilon are unchanged: only how a drawn "
                    "micro-batch is cut into passes changes, each unit whole in one pass", len(take), self.cap,
                    self.sample_rate, self.expected_batch_size,
                )
                continue
            pending = pending[len(take):]
            total = loss if total is None else total + loss
        return total


def unit_rows(unit_ids: Optional[torch.Tensor], rows: int) -> List[torch.Tensor]:
    """The row indices of each unit, in order of first row (a unit per row when ``unit_ids`` is None)."""
    if unit_ids is None:
        return list(torch.arange(rows).split(1))
    ids = torch.as_tensor(unit_ids).flatten()
    order: Dict[int, List[int]] = {}
    for row, unit in enumerate(ids.tolist()):
        order.setdefault(unit, []).append(row)
    return [torch.tensor(r, dtype=torch.long) for r in order.values()]


def select_rows(batch: Dict[str, Any], index: torch.Tensor, rows: int) -> Dict[str, Any]:
    """The rows ``index`` of every tensor of ``batch`` with ``rows`` rows; other entries as they are."""
    return type(batch)({key: value.index_select(0, index.to(value.device))
                        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows else value
                        for key, value in batch.items()})


def _rows(batch: Dict[str, Any]) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    raise ValueError("auto_find_batch_size: the micro-batch holds no tensor with rows")


def check_physical_batches(trainer: Any, packing: Any) -> Optional[PhysicalBatchSearch]:
    """The search for a trainer with ``auto_find_batch_size`` (None without it); refuses batch layouts it cannot cut
    by units."""
    if not trainer.args.auto_find_batch_size:
        return None
    if packing is not None or trainer._dp_recipe.rows_per_example != 1:
        raise ValueError(
            "auto_find_batch_size in the private Trainer cuts a micro-batch into passes by whole rows, one example "
            "per row; packed rows (packing, padding_free) and DPO's paired rows are not cut. Set "
            "per_device_train_batch_size yourself"
        )
    plan = trainer.privacy_plan
    logger.info("auto_find_batch_size: after an out-of-memory error the private Trainer runs fewer units per forward "
                "and backward pass; the Poisson sampling (rate %.4g) and the accounting stay those of "
                "per_device_train_batch_size=%d", plan.sample_rate, trainer.args.per_device_train_batch_size)
    return PhysicalBatchSearch(plan.sample_rate, plan.expected_batch_size)


@contextlib.contextmanager
def no_restarts(args: Any, search: Optional[PhysicalBatchSearch]):
    """transformers' own ``auto_find_batch_size`` off for the block (its restart with half the batch would change
    ``q`` and repeat accounted steps) when the private search runs instead."""
    if search is None:
        yield
        return
    args.auto_find_batch_size = False
    try:
        yield
    finally:
        args.auto_find_batch_size = True
