"""The gradient writer: where a DP optimizer keeps its clipped sums and writes its noised gradient.

The DP optimizer forms each backward pass's clip factors; the writer it holds (``DPOptimizer.gradient_writer``)
then does the two things that depend on how the parameters are laid out over the ranks:

* ``keep(optimizer, hooks, factors, dropped)``, after every backward pass on every rank (``factors`` empty for a
  pass that adds nothing: a phantom, no unit), so that a writer's collectives pair up on all ranks: it keeps the
  clipped sums of the parameters it lays out itself in ``optimizer._summed`` and returns the factors of the
  others, whose clipped sums the optimizer then adds up whole;
* ``write(optimizer, params)``, once per step: the ranks' clipped sums added up, noise once per element (the
  plan's std), divided by the plan's divisor under ``loss_reduction="mean"``, put where the inner optimizer steps
  from (``p.grad``, or the engine's own buffer).

One writer per layout: :class:`WholeParameters` (one process, DDP: whole parameters on every rank),
``distributed.fsdp.ShardedParameters`` (FSDP2 and HSDP shards), ``distributed.tensor_parallel.TensorParallelSlices``
(tensor-parallel slices, alone or with FSDP2), chosen by the optimizer from its parameters; and
``distributed.deepspeed_zero12.Zero12Partitions`` and ``distributed.deepspeed_zero3.Zero3Partitions`` (the
partitions of ZeRO's flat groups and of ZeRO-3's parameters, which no parameter shows), given to the optimizer by
``distributed.deepspeed.attach`` through ``DPOptimizer.use_gradient_writer``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence

import torch
from torch import nn

from dptorch.distributed.fsdp import add_noise_per_parameter
from dptorch.distributed.noise import ShardedNoise
from dptorch.noise.gaussian import add_noise_

Factors = Dict[nn.Parameter, torch.Tensor]


class GradientWriter(Protocol):
    def keep(self, optimizer: Any, hooks: Any, factors: Factors, dropped: Optional[torch.Tensor] = None) -> Factors:
        """Keep this backward pass's clipped sums of the parameters this writer lays out; the factors of the rest."""

    def write(self, optimizer: Any, params: Sequence[nn.Parameter]) -> None:
        """Write ``(sum over the ranks of the clipped sums + noise) / divisor`` for ``params`` (not empty)."""


class WholeParameters:
    """Whole parameters on every rank: the optimizer keeps the clipped sums whole; at the step the noise of the
    whole flat vector is drawn once, on rank 0, added to its sums and all-reduced, so every rank writes the same
    ``p.grad`` (with a ``ShardedNoise``, the per-element stream of the sharded layouts instead)."""

    def keep(self, optimizer: Any, hooks: Any, factors: Factors, dropped: Optional[torch.Tensor] = None) -> Factors:
        return factors

    def write(self, optimizer: Any, params: Sequence[nn.Parameter]) -> None:
        if isinstance(optimizer.noise_generator, ShardedNoise):  # noise per parameter element
            return add_noise_per_parameter(optimizer, params)
        sizes = [p.numel() for p in params]
        device = params[0].device
        std = optimizer.noise_std
        if optimizer._world_size == 1:
            return _write_one_process(optimizer, params, sizes, std)
        noise = None
        if std > 0 and optimizer._rank == 0:  # the noise of the whole flat vector, one draw; the sums go into it
            shape_only = torch.zeros(1, dtype=torch.float32, device=device).expand(sum(sizes))
            noise = optimizer.noise_generator.noise_like(shape_only, std).reshape(-1)
        flat = noise if noise is not None else torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        held = [(part, optimizer._summed[p]) for p, part in zip(params, flat.split(sizes)) if p in optimizer._summed]
        if held:  # z + s (the same bits as s + z), one fused call for all parameters
            torch._foreach_add_([part for part, _ in held], [s.reshape(-1).to(device) for _, s in held])
        torch.distributed.all_reduce(flat)
        if optimizer.loss_reduction == "mean":  # the plan's constant, never the drawn batch's size (post-processing)
            flat.div_(optimizer.plan.divisor)
        _set_grads(params, flat.split(sizes))


def _write_one_process(optimizer: Any, params: Sequence[nn.Parameter], sizes: Sequence[int], std: float) -> None:
    """``WholeParameters.write`` on one process: each held clipped sum becomes its parameter's gradient in place
    (``s += z``, ``s /= divisor``: the same bits as the flat vector's ``z + s``), with no flat buffer: the noise
    of the flat vector is added part by part (``add_noise_``: on the CPU chunk by chunk, never model-sized).
    The held sums are the optimizer's own (``state_dict`` hands out copies; one that shares memory with
    another is copied first). A parameter without a clipped sum gets its noise (or zeros)."""
    device = params[0].device
    grads: List[torch.Tensor] = []
    held: List[int] = []
    for i, p in enumerate(params):
        summed = optimizer._summed.get(p)
        if summed is None:  # -0.0 is the addition's identity: the gradient is the noise's own bits
            grads.append(torch.full((sizes[i],), -0.0 if std > 0 else 0.0, dtype=torch.float32, device=device))
            continue
        grads.append(summed.to(device, torch.float32).contiguous())
        held.append(i)
    for i in _sharing_memory([grads[i] for i in held]):
        grads[held[i]] = grads[held[i]].clone()
    if std > 0:
        add_noise_(grads, std, optimizer.noise_generator)
    if optimizer.loss_reduction == "mean":  # the plan's constant, never the drawn batch's size (post-processing)
        torch._foreach_div_(grads, optimizer.plan.divisor)
    _set_grads(params, grads)


def _sharing_memory(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Indices of the tensors whose memory overlaps an earlier one's (the same tensor twice, overlapping views)."""
    spans = sorted([(start := t.data_ptr(), start + t.nbytes, i) for i, t in enumerate(tensors) if t.nbytes])
    shared, end = [], -1
    for start, stop, i in spans:
        if start < end:
            shared.append(i)
        if stop > end:
            end = stop
    return shared


def _set_grads(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
    """``p.grad`` from each flat float32 gradient, in the parameter's shape and dtype."""
    for param, grad in zip(params, grads):
        grad = grad if grad.shape == param.shape else grad.view_as(param)
        param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)


__all__ = ["GradientWriter", "WholeParameters"]
