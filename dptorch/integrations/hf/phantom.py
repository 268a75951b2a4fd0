"""Phantom micro-batches: what a rank runs for a micro-batch that Poisson sampling left empty.

On one process the private Trainer skips an empty micro-batch (a model cannot run on zero rows)
and the optimizer step still adds the noise. On several processes the ranks must run the same
forwards and backwards: FSDP2 all-gathers the parameters in every forward and the DP optimizer
reduce-scatters the clipped sums after every backward, and TRL's DPO ``compute_loss`` gathers its
metrics on every micro-batch. A rank whose micro-batch is empty therefore runs a *phantom*: a
forward and backward of a stand-in batch that

* holds no private data: every value is a constant (1 under keys that name a mask, 0 elsewhere:
  token ids, labels, positions, features); only its structure (keys, dtypes, the shape but for the
  rows) is taken from one collated training row, and it never leaves the rank;
* adds nothing: its loss is multiplied by 0, and the DP optimizer discards its backward round
  (:meth:`~dptorch.optim.DPOptimizer.phantom`): no clip factor is formed and, under FSDP2, the rank
  reduce-scatters zeros, so the clipped sum of the step is the other ranks' sum bit for bit;
* counts nothing: it is no unit of the Poisson draw (the expected batch size, the step count and
  the accountant do not see it), its loss is logged as 0 like a skipped micro-batch, its tokens
  are not counted, and TRL's metrics do not see its rows (:mod:`.metrics`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch


def neutral_batch(template: Any) -> Dict[str, Any]:
    """``template`` (a collated batch) with every tensor's values replaced by constants: ones under
    keys containing ``"mask"``, zeros elsewhere. Refuses values it cannot neutralise."""
    if not hasattr(template, "keys"):
        raise TypeError(
            f"a phantom micro-batch needs the collator to return a dict of tensors, got {type(template).__name__}"
        )
    batch: Dict[str, Any] = {}
    for key in template.keys():
        value = template[key]
        if value is None:
            batch[key] = None
        elif isinstance(value, torch.Tensor):
            batch[key] = torch.ones_like(value) if "mask" in str(key) else torch.zeros_like(value)
        else:
            raise TypeError(
                f"the collated batch holds {key!r} of type {type(value).__name__}; a phantom micro-batch (run on a "
                "rank whose Poisson micro-batch is empty, so that the ranks' collectives pair up) can only replace "
                "tensor values by constants. Make the collator return tensors only"
            )
    return batch


class PhantomBatch:
    """Hands out the phantom micro-batch of a training set (built once, on first use).

    ``collate`` is the training collator and ``dataset`` the training set (as the loader reads it);
    the template is ``collate([dataset[0]])``, whose values :func:`neutral_batch` replaces.
    """

    def __init__(self, collate: Callable[[List[Any]], Any], dataset: Any) -> None:
        self.collate = collate
        self.dataset = dataset
        self._batch: Optional[Dict[str, Any]] = None

    def __call__(self) -> Dict[str, Any]:
        if self._batch is None:
            self._batch = neutral_batch(self.collate([self.dataset[0]]))
        return dict(self._batch)  # a new dict each time: the trainer pops keys from it
