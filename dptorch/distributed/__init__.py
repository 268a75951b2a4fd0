"""Private training on torch.distributed: DDP, FSDP2 (``fully_shard``, HSDP included), tensor parallelism and DeepSpeed ZeRO.

dptorch builds no transport of its own; it uses the process group torch.distributed (or
``torchrun`` / ``accelerate launch``) set up. What this package owns:

* ``ddp``: a DistributedDataParallel model keeps its gradient all-reduce out of the way. The DP
  optimizer adds up the *clipped* sums of all ranks itself (one all-reduce per logical step) and
  draws the noise once, on rank 0, so DDP's reduction of the raw gradients is switched off for
  each forward of a private model (and the layers' own parameters stay out of autograd, as on one
  process; a gradient by a path the controller does not see is refused there too).
* ``fsdp``: parameters sharded by ``fully_shard`` (DTensors). Each sample's gradient is formed on
  the rank that holds the sample, from the full (all-gathered) layer, so its norm is complete
  there; the clipped sums are reduce-scattered after every backward pass and stay sharded; each
  rank draws only its shard's slice of one global noise stream (``noise.ShardedNoise``).
  On a 2-D ``(replicate, shard)`` mesh (HSDP) the shards are summed over the replicas once per step;
  under CPU offloading each shard's noise and step happen where it lives.
* ``noise``: ``ShardedNoise``, Gaussian noise that is a function of (seed, step, parameter,
  element), whatever the sharding or the number of processes.
* ``agreement``: every rank must build the same privacy plan; a difference (batch size, dataset length,
  noise, clipping, ...) is refused on every rank, with one message, where the plan is built.
* ``checkpoint``: engine checkpoints of sharded runs (a directory: DCP shards and rank 0's state).
* ``tensor_parallel``: ``parallelize_module`` (ColwiseParallel / RowwiseParallel, row-split embeddings,
  SequenceParallel norms) and transformers' ``tp_plan``, alone or with FSDP2 on a (dp, tp) mesh: every
  rank of a tensor-parallel group runs the same batch, the ranks' partial per-sample norms are added up
  before clipping (a SequenceParallel norm's partial per-sample gradients first), each rank keeps its
  slice of the clipped sum and of the one noise stream.
* ``deepspeed`` (and ``deepspeed_zero12``, ``deepspeed_zero3``, ``partitions``): ZeRO-1, 2 and 3, the clipped
  sums reduce-scattered into each rank's ZeRO partition after every backward pass, noised there and handed to
  DeepSpeed's step (``engine.step()`` is the DP step).

The HF Trainer on several processes (DDP, Accelerate's FSDP2) builds on these; what it adds (phantom
micro-batches, metric gathers of any size) lives in ``dptorch.integrations.hf``.

``DifferentiallyPrivateDistributedDataParallel`` (Opacus' name) is torch's DDP itself.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "DifferentiallyPrivateDistributedDataParallel": "dptorch.distributed.ddp",
    "ShardedNoise": "dptorch.distributed.noise",
    "rank_and_world_size": "dptorch.distributed.ddp",
    "is_ddp": "dptorch.distributed.ddp",
    "keep_out_of_gradient_sync": "dptorch.distributed.ddp",
    "is_sharded": "dptorch.distributed.fsdp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # lazy: the package's modules load on first use
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dptorch.distributed' has no attribute {name!r}")
