"""Data leaving torch, or coming back: where the tracker cannot follow values, it refuses.

Inside the capturing root forward, reading a batch-derived tensor's values out of torch
(``.numpy()``, ``.tolist()``, ``.item()``, ``float(t)``, ``str(t)``, its storage, pickling) is refused: what
comes back (``torch.from_numpy``, ``torch.tensor`` of a list, a Python number in ``h * x``) is
invisible to a ``TorchFunctionMode``, so it could carry one sample's data into every other's
computation. After the forward (the loss, metrics, logging) such a read is allowed and recorded
(``tracker.escaped``; ``loss.py`` refuses a total scaled by a Python number after it). A
branch on a batch-derived condition (``if mask.all():``, ``__bool__``) is allowed: HF models use it
to choose between equal computations (a mask of ones or none); the tracker cannot see control
flow (see docs/privacy.md).

``t.data = v`` gives ``t`` the tag of ``v``; ``copy.deepcopy(t)`` and ``torch.tensor(t)`` copy a
tag; a hook registered on a batch-derived tensor during the forward is refused (it could change
the gradient in backward, where nothing is followed).
"""

from __future__ import annotations

from typing import Callable, Dict

from torch import Tensor

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tracking.args import Tracker, arg, caller, op_name, tensors_of
from dptorch.grad_sample.tracking.writes import derived

_READS = """item tolist numpy __array__ __float__ __int__ __index__ __complex__ __reduce_ex__ __getstate__
untyped_storage storage __repr__ __format__""".split()


def escape(tr: Tracker, func, args, kwargs):
    name = op_name(func)
    x = args[0] if args else None
    tag = tr.get(x) if isinstance(x, Tensor) else None
    if derived(tag) and tr.n > 1:
        if name == "register_hook" and _registered_by_torch():  # FSDP2's pre-backward hooks, DDP's sink, DeepSpeed's
            return tr.run(func, args, kwargs)
        if not tr.forward_done or tr.nested_forwards:  # (a forward of the model in the loss phase counts too)
            what = "registers a hook on" if name == "register_hook" else f"calls {name}() on"
            why = ("the hook could change its gradient in backward, where the batch tracker cannot follow it"
                   if name == "register_hook" else "its values leave torch (to Python or numpy), where the batch "
                   "tracker cannot follow them, so what is computed from them could mix the samples")
            source = "a batched tensor" if type(tag) is int else f"a tensor derived from the batch ({tag.reason})"
            raise PerSampleGradientError(
                f"the model's forward {what} {source}: {why}. Keep the computation in torch operations, or move "
                "it out of the training forward. Nothing was updated."
            )
        tr.escaped = tr.escaped or f"{name}() of a tensor derived from the batch"
    return tr.run(func, args, kwargs)


def _registered_by_torch() -> bool:
    """Whether the hook being registered comes from torch itself (its distributed wrappers), which
    moves gradients without changing them, or from DeepSpeed's engine forward (its output hooks divide
    the gradient by the constant gradient_accumulation_steps)."""
    module = caller()
    return module == "torch" or module.startswith("torch.") or module == "deepspeed.runtime.utils"


def _copy(tr: Tracker, func, args, kwargs):
    """``copy.deepcopy(t)``, ``torch.tensor(t)``, ``x.new_tensor(t)``: a copy of a tensor's values."""
    data = args[1] if op_name(func) == "new_tensor" and len(args) > 1 else arg(args, kwargs, 0, "data")
    if op_name(func) == "new_tensor" and len(args) <= 1:
        data = kwargs.get("data")
    tags = [tr.get(t) for _, t in tensors_of(args, kwargs)]
    out = tr.run(func, args, kwargs)
    if isinstance(data, Tensor):
        tr.put_all(out, tr.get(data))
    elif any(derived(g) for g in tags) or isinstance(data, (list, tuple)):
        tr.put_all(out, tr.lost_from(f"{op_name(func)} of data derived from the batch", tags))
    return out


def _set_data(tr: Tracker, func, args, kwargs):
    """``t.data = v``: ``t`` now holds ``v``'s values (its old memory, and its aliases, are untouched)."""
    target, value = args[0], args[1]
    out = tr.run(func, args, kwargs)
    tr.put(target, tr.get(value) if isinstance(value, Tensor) else None)
    return out


def _keep(tr: Tracker, func, args, kwargs):  # setting an attribute that holds no data of the batch
    return tr.run(func, args, kwargs)


RULES: Dict[str, Callable] = {n: escape for n in _READS}
RULES.update({"register_hook": escape, "__deepcopy__": _copy, "tensor": _copy, "as_tensor": _copy, "asarray": _copy,
              "new_tensor": _copy, "set:data": _set_data, "set:requires_grad": _keep, "set:grad": _keep,
              "set:retains_grad": _keep, "set:names": _keep, "set:name": _keep})
