"""Memory lent for per-sample gradients on the CPU, taken back once nothing else holds it.

A model's per-sample gradients are B times its parameters (1.25 GB for 19.6M parameters at
batch 16). Allocated afresh every step, that memory goes back to the OS when the step frees it
and is page-faulted in again by the next step: on wide GPT-2 in hooks mode (2-core CPU) that was
240k page faults, about 10% of the step. A ``BufferPool`` keeps the blocks of the last round and
lends them again. A block is taken back only when no tensor, view or storage object outside the
pool refers to its memory, so a ``grad_sample`` a caller kept is never overwritten: its block just
leaves the pool. Off the CPU (CUDA keeps freed memory in its caching allocator), or where torch
cannot count storage references, the pool only allocates.
"""

from __future__ import annotations

import math
import sys
from typing import List, Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

_CAN_COUNT = hasattr(torch._C, "_storage_Use_Count")


def _references(block: torch.Tensor) -> tuple:
    """(C++ handles on the block's storage, Python references to its storage object)."""
    storage = block.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


_UNSHARED = _references(torch.empty(1)) if _CAN_COUNT else None  # a block only the pool holds


def _tracing() -> bool:
    """Whether a graph is being traced (``make_fx``: its proxy mode is active): no memory to lend."""
    return get_proxy_mode() is not None


class BufferPool:
    """Lends uninitialised tensors (``empty``) and takes the unshared ones back (``reclaim``)."""

    def __init__(self) -> None:
        self._free: List[torch.Tensor] = []  # flat blocks ready to lend
        self._lent: List[torch.Tensor] = []  # flat blocks lent since the last reclaim

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor, in the smallest free block that holds it."""
        device = torch.device(device)
        if device.type != "cpu" or _UNSHARED is None or _tracing():  # a captured step's trace: fake tensors
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        fits = [i for i, block in enumerate(self._free) if block.dtype == dtype and block.numel() >= numel]
        if fits:
            block = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:  # a quarter of headroom (never touched, so never resident) for a larger Poisson batch
            self._release_outgrown(numel, dtype)
            block = torch.empty(numel + numel // 4, dtype=dtype)
        self._lent.append(block)
        # A new tensor on the block's storage, not a view of it: the block itself stays unreachable.
        return torch.empty(0, dtype=dtype).set_(block.untyped_storage(), 0, tuple(shape))

    def _release_outgrown(self, numel: int, dtype: torch.dtype) -> None:
        """Let go of the largest free block of ``dtype`` too small for ``numel``: the block this request
        had last round, outgrown by a larger Poisson batch. Kept until ``reclaim``, it would be resident
        beside its successor for the whole round (hooks on wide Llama through ``make_private``, a Poisson
        batch of 19 then one of 26: that step's peak RSS 4,532 MB with the old block kept, 3,762 MB without)."""
        small = [i for i, block in enumerate(self._free) if block.dtype == dtype and block.numel() < numel]
        if small:
            del self._free[max(small, key=lambda i: self._free[i].numel())]

    def reclaim(self) -> None:
        """Take back the lent blocks nothing else refers to, in place of the free ones (after a round
        that lent nothing, the free blocks are kept as they are)."""
        if self._lent:
            self._free = [block for block in self._lent if _references(block) == _UNSHARED]
            self._lent = []
