"""Engine checkpoints of FSDP2-sharded runs: a directory, written by every rank together.

The model's and the inner optimizer's states are sharded (DTensors), so they go through
``torch.distributed.checkpoint`` (DCP: each rank writes its shards, a resumed run may reshard).
Everything else a run needs to continue (accountant history, privacy plan, the DP optimizer's noise
generator and flags, schedulers, sampler position, the caller's entries) is the same on every rank,
or rank 0's by definition (the noise stream), and rank 0 writes it to :data:`STATE_FILE` in the
same directory, after DCP finished.

DCP's optimizer state helpers create a missing state by stepping the optimizer once, so they are
handed the inner torch optimizer: that step must never reach the DP optimizer (it would add noise
and account a step).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
from torch import nn

from dptorch.distributed.ddp import rank_and_world_size
from dptorch.distributed.fsdp import any_sharded

#: Rank 0's file of the replicated state, inside the checkpoint directory.
STATE_FILE = "dptorch_state.pt"


def is_sharded_model(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is an FSDP2 shard (a DTensor)."""
    return any_sharded(list(module.parameters()))


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a directory written by :func:`save_sharded`."""
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(path), STATE_FILE))


def _dcp_states(module: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(module)}
    model, optim = get_state_dict(module, optimizer)
    return {"model": model, "optimizer": optim}


def save_sharded(path: Any, module: nn.Module, optimizer: Optional[torch.optim.Optimizer], state: Dict[str, Any]) -> None:
    """Write ``module``'s and the inner ``optimizer``'s sharded states (DCP) and rank 0's ``state`` to the
    directory ``path``. Every rank must call it (DCP's writes are collective)."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "a checkpoint of an FSDP2-sharded model is a directory (every rank writes its shards): pass a path, "
            f"not {type(path).__name__}"
        )
    folder = os.fspath(path)
    dcp.save(_dcp_states(module, optimizer), checkpoint_id=folder)
    rank, world = rank_and_world_size()
    if rank == 0:
        tmp = os.path.join(folder, f"{STATE_FILE}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(folder, STATE_FILE))  # the directory counts as a checkpoint once this exists
    if world > 1:
        torch.distributed.barrier()


def read_state(path: Any, **load_kwargs: Any) -> Dict[str, Any]:
    """Rank 0's state in the checkpoint directory ``path`` (``weights_only`` unless ``load_kwargs`` say otherwise)."""
    return torch.load(os.path.join(os.fspath(path), STATE_FILE), **{"weights_only": True, **load_kwargs})


def load_sharded(path: Any, module: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Load the sharded states of the directory ``path`` into ``module`` and, when given, the inner
    ``optimizer`` (every rank; DCP reshards to this run's mesh)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    states = _dcp_states(module, optimizer)
    dcp.load(states, checkpoint_id=os.fspath(path))
    if optimizer is None:
        set_model_state_dict(module, states["model"])
    else:
        set_state_dict(module, optimizer, model_state_dict=states["model"], optim_state_dict=states["optimizer"])


__all__ = ["STATE_FILE", "is_sharded_checkpoint", "is_sharded_model", "load_sharded", "read_state", "save_sharded"]
