"""DistributedDataParallel under DP-SGD: DDP's all-reduce of raw gradients is switched off.

DDP all-reduces ``p.grad`` as autograd produces it, layer by layer, during backward. A private
step needs something else: every sample's gradient clipped first (which needs the norm over all
layers, known only when backward ends), then the clipped sums of all ranks added up, then noise
drawn once. The DP optimizer does exactly that (one all-reduce of the clipped sums per logical
step, noise on rank 0), so DDP's own reduction is redundant, and worse, it is what forbade
keeping the layers' parameters out of autograd: DDP's reducer expects a gradient for every
parameter and fails ("Expected to have finished reduction in the prior iteration") when one
never comes.

``keep_out_of_gradient_sync(ddp)`` sets ``ddp.require_backward_grad_sync = False`` for the
duration of each forward call (a forward pre-hook, restored by a forward hook), the same switch
``ddp.no_sync()`` uses: DDP then neither prepares its reducer nor expects gradients, and its
later state (a user's ``no_sync()`` included) is as before. With it the controller keeps each
hooked layer's own parameters out of autograd under DDP as on one process, so a gradient that
still reaches a parameter came by a path it does not see, and is refused, on every rank.

No collective runs per forward or backward (DDP's broadcast of the buffers is skipped as well),
so ranks may even run different numbers of micro-batches per step (a loop may skip its empty
Poisson batches); the one collective is the optimizer's per step. (The private Trainer still runs
an empty micro-batch as a phantom on several processes: FSDP2 and metric gathers need every rank.)
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn


def rank_and_world_size(group: Any = None) -> Tuple[int, int]:
    """(rank, world size) in ``group`` (default: the default process group), or (0, 1) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def is_ddp(module: Any) -> bool:
    """Whether ``module`` is a ``torch.nn.parallel.DistributedDataParallel``."""
    return isinstance(module, nn.parallel.DistributedDataParallel)


class _SyncSwitch:
    """The pre/post forward hooks of one DDP module, shared by everyone who asked for them."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self.saved: List[Tuple[bool, bool]] = []
        self.users: Dict[int, Callable[[], bool]] = {}  # handle id -> whether it wants the sync off now
        self.handles = [
            ddp.register_forward_pre_hook(self._before),
            ddp.register_forward_hook(self._after, always_call=True),
        ]

    def _before(self, module: nn.Module, args: Any) -> None:
        self.saved.append((module.require_backward_grad_sync, module.require_forward_param_sync))
        if any(wants() for wants in self.users.values()):
            # No gradient reduction, and no buffer broadcast either: DDP would broadcast the buffers
            # in the first forward, a collective that a rank whose first batch was empty (and skipped
            # by its loop) would meet with another one (the step's all-reduce). The buffers of a model
            # that can be trained privately do not change in training (BatchNorm is refused), and
            # DDP broadcast them when it was built.
            module.require_backward_grad_sync = False
            module.require_forward_param_sync = False

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.saved:
            module.require_backward_grad_sync, module.require_forward_param_sync = self.saved.pop()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


_SWITCHES: "weakref.WeakKeyDictionary[nn.Module, _SyncSwitch]" = weakref.WeakKeyDictionary()


class _Handle:
    def __init__(self, ddp: nn.Module) -> None:
        self._ddp: Optional[weakref.ref] = weakref.ref(ddp)
        self.removed = False

    def remove(self) -> None:
        ddp = self._ddp() if self._ddp is not None else None
        self._ddp = None
        switch = _SWITCHES.get(ddp) if ddp is not None else None
        self.removed = True
        if switch is None:
            return
        switch.users.pop(id(self), None)
        if not switch.users:
            switch.remove()
            _SWITCHES.pop(ddp, None)


def keep_out_of_gradient_sync(
    ddp: nn.parallel.DistributedDataParallel, when: Optional[Callable[[], bool]] = None
) -> _Handle:
    """Switch DDP's gradient all-reduce off for every forward of ``ddp``; ``.remove()`` undoes it.

    ``when()``, if given, is asked at each forward (the controller: only while it keeps the
    parameters out of autograd). Several callers (the controller attached to the DDP module, the
    private Trainer) may ask for the same module; the hooks are installed once, the sync is off
    when any of them wants it, and the hooks go with the last handle.
    """
    if not is_ddp(ddp):
        raise TypeError(f"keep_out_of_gradient_sync needs a DistributedDataParallel, got {type(ddp).__name__}")
    if getattr(ddp, "static_graph", False):
        raise ValueError(
            "DistributedDataParallel(static_graph=True) is not supported with DP-SGD: its delayed all-reduce of the "
            "raw gradients runs outside the forward the private model switches off; build DDP without static_graph"
        )
    switch = _SWITCHES.get(ddp)
    if switch is None:
        switch = _SWITCHES[ddp] = _SyncSwitch(ddp)
    handle = _Handle(ddp)
    switch.users[id(handle)] = when or (lambda: True)
    return handle


def ddp_wrappers(model: Any) -> List[nn.parallel.DistributedDataParallel]:
    """The DDP modules in an Accelerate/Trainer wrapper chain (``.module`` links), outermost first."""
    found: List[nn.parallel.DistributedDataParallel] = []
    seen: Dict[int, None] = {}
    while isinstance(model, nn.Module) and id(model) not in seen:
        seen[id(model)] = None
        if is_ddp(model):
            found.append(model)
        model = getattr(model, "module", None)
    return found


#: Opacus' name (``opacus.distributed.DifferentiallyPrivateDistributedDataParallel``). Opacus' wrapper only makes all
#: ranks start from rank 0's weights and leaves gradient synchronisation to its distributed optimizer;
#: dptorch's DPOptimizer does that synchronisation itself and works with torch's own
#: DistributedDataParallel (which broadcasts rank 0's weights at construction), so that is the class.
DifferentiallyPrivateDistributedDataParallel = nn.parallel.DistributedDataParallel


__all__ = [
    "DifferentiallyPrivateDistributedDataParallel", "ddp_wrappers", "is_ddp", "keep_out_of_gradient_sync",
    "rank_and_world_size",
]
