"""Metric gathers inside ``compute_loss`` on several processes, under Poisson sampling.

TRL's DPO ``compute_loss`` gathers its metrics (rewards, log-probabilities, token counts, ...)
over the ranks on every micro-batch with ``accelerator.gather`` / ``gather_for_metrics``. Both
assume every rank holds a batch of the same size. Under Poisson sampling the ranks' micro-batches
differ in size (a mismatched all-gather aborts under gloo and hangs or corrupts under NCCL), and a
rank that runs a phantom micro-batch (:mod:`.phantom`) must add nothing to them.

* :func:`exact_gathers` replaces both methods, for one ``compute_loss``, by a gather of tensors of
  any length along dim 0 (a 0-dim tensor counts as one row): every rank sends its rows, a phantom
  sends none, and every rank gets the concatenation of the real rows in rank order. Sums and means
  over the gathered values are those of the real micro-batches, the same on every rank, a phantom
  rank included (it logs the others' metrics).
* :func:`dropped_metrics` removes what one ``compute_loss`` appended to TRL's metric lists
  (``trainer._metrics``) when a gather found no row at all (every rank ran a phantom): its values
  (means of nothing) would otherwise enter the averages.

These metrics are not private (docs/hf.md): they are logged without noise, as on one process.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List

import torch
from torch.utils._pytree import tree_flatten, tree_map


def gather_rows(data: Any, phantom: bool = False) -> Any:
    """Every rank's rows of ``data`` (a tensor, or a dict/list/tuple of them), concatenated along dim 0.

    Ranks may hold different numbers of rows; ``phantom=True`` sends none. Needs every rank to call it.
    """
    dist = torch.distributed
    world = dist.get_world_size()
    mine = tree_map(lambda t: (_rows(t)[:0] if phantom else _rows(t)).detach().cpu(), data)
    parts: List[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return tree_map(lambda like, *ranks: torch.cat(ranks).to(device=like.device, dtype=like.dtype), data, *parts)


class Gathers:
    """What :func:`exact_gathers` saw: ``found_nothing`` once a gather found no row on any rank."""

    found_nothing = False


@contextlib.contextmanager
def exact_gathers(accelerator: Any, phantom: bool = False) -> Iterator[Gathers]:
    """``accelerator.gather`` and ``gather_for_metrics`` as :func:`gather_rows` (tensors only) for the block."""
    originals = {name: accelerator.__dict__.get(name) for name in ("gather", "gather_for_metrics")}
    gather, gather_for_metrics = accelerator.gather, accelerator.gather_for_metrics
    seen = Gathers()

    def rows(data: Any) -> Any:
        result = gather_rows(data, phantom)
        seen.found_nothing = seen.found_nothing or _has_no_rows(result)
        return result

    def exact(data: Any, *args: Any, **kwargs: Any) -> Any:
        return rows(data) if _only_tensors(data) else gather(data, *args, **kwargs)

    def exact_for_metrics(data: Any, use_gather_object: bool = False) -> Any:
        if use_gather_object or not _only_tensors(data):
            return gather_for_metrics(data, use_gather_object=use_gather_object)
        return rows(data)

    accelerator.gather, accelerator.gather_for_metrics = exact, exact_for_metrics
    try:
        yield seen
    finally:
        for name, value in originals.items():
            if value is None:
                accelerator.__dict__.pop(name, None)
            else:
                setattr(accelerator, name, value)


@contextlib.contextmanager
def dropped_metrics(trainer: Any, when: Callable[[], bool]) -> Iterator[None]:
    """Undo what the block appended to the lists of ``trainer._metrics`` (TRL's per-mode metric lists)
    if ``when()`` holds at its end."""
    metrics = getattr(trainer, "_metrics", None)
    metrics = metrics if isinstance(metrics, dict) else {}
    modes = {mode: values for mode, values in metrics.items() if isinstance(values, dict)}
    lengths = {mode: {k: len(v) for k, v in values.items() if isinstance(v, list)} for mode, values in modes.items()}
    try:
        yield
    finally:
        if when():
            for mode, values in modes.items():
                for key in list(values):
                    if key not in lengths[mode]:
                        del values[key]
                    elif isinstance(values[key], list):
                        del values[key][lengths[mode][key]:]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1) if t.dim() == 0 else t


def _has_no_rows(data: Any) -> bool:
    return any(leaf.shape[0] == 0 for leaf in tree_flatten(data)[0])


def _only_tensors(data: Any) -> bool:
    return all(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(data)[0])
