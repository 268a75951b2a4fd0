"""What a captured step's graph froze of the model, and whether it still holds (``dptorch.optim.captured_step``).

A trace depends on more than the batch's values: on each module's plain attributes (``training``, a
dropout's ``p``, an ``eps``), its hooks, its class's ``forward``, which parameters, buffers and children it
holds and whether each parameter requires a gradient, on global module hooks, and on the plain
attributes of an attribute named ``config`` (HF models read their config in the forward). A
``ModelGuard`` keeps, at the trace, the dicts that hold all of these and what they held; ``holds()``
compares them again before every replay. The comparison is by value for plain entries and by identity
for the objects (a replaced parameter, hook, child or config object fails it), at C speed: tuples of
the dicts' contents.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as torch_modules

#: The hook tables a forward or backward runs (the ``_with_kwargs`` and ``_always_called`` tables are keyed
#: by entries of these).
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                       "_global_backward_hooks")


class ModelGuard:
    """The state of ``model`` a trace could depend on, as it was when made; ``holds()``: still so."""

    def __init__(self, model: nn.Module) -> None:
        modules = list(model.modules())
        configs = {id(c): c for c in (m.__dict__.get("config") for m in modules) if c is not None and
                   not isinstance(c, nn.Module) and hasattr(c, "__dict__")}
        self._tables = [t for m in modules for t in (m.__dict__, m._parameters, m._buffers, m._modules)]
        self._tables += [vars(c) for c in configs.values()]
        self._hooks = [getattr(m, name) for m in modules for name in _HOOK_TABLES]
        self._hooks += [getattr(torch_modules, name) for name in _GLOBAL_HOOK_TABLES]
        self._modules = modules
        self._params = [p for m in modules for p in m._parameters.values() if p is not None]
        self._state = self._read()

    def _read(self) -> tuple:
        return (list(map(tuple, map(dict.values, self._tables))), list(map(tuple, self._hooks)),
                [type(m).forward for m in self._modules], [p.requires_grad for p in self._params])

    def holds(self) -> bool:
        """Whether the model is as it was when the guard was made (an entry that cannot be compared: not)."""
        try:
            return bool(self._read() == self._state)
        except Exception:  # noqa: BLE001 - e.g. a tensor attribute replaced: its == has no truth value
            return False

