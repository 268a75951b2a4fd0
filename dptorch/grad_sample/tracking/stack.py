"""Where the batch tracker sits on torch's stack of function modes.

After a root forward the tracker keeps following the loss (``loss.py``) until backward. It then
sits at the bottom of the stack, so that modes the user enters and leaves afterwards (a
``torch.device`` context, say) push and pop above it as if it were not there. Only call these
outside a mode's ``__torch_function__`` (torch stashes the running modes there).
"""

from __future__ import annotations

from typing import List

import torch
from torch.overrides import TorchFunctionMode

from dptorch.grad_sample.tracking.unseen import follow as follow_unseen


def _modes() -> List[TorchFunctionMode]:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _replace_stack(modes: List[TorchFunctionMode]) -> None:
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)
    follow_unseen()  # the guard of operations run with torch functions off follows the trackers (unseen.py)


def sink(mode: TorchFunctionMode) -> None:
    """Put ``mode`` at the bottom of the stack (taking it from where it is, if it is on it)."""
    _replace_stack([mode] + [m for m in _modes() if m is not mode])


def on_stack(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is on the stack now (a mode running its ``__torch_function__`` is not)."""
    return any(m is mode for m in _modes())


def remove(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off the stack, wherever it is; the others keep their order."""
    modes = _modes()
    if any(m is mode for m in modes):
        _replace_stack([m for m in modes if m is not mode])


def remove_finished() -> None:
    """Take off the stack every mode that says it is ``done`` (trackers whose loss was checked)."""
    modes = _modes()
    if any(getattr(m, "done", False) for m in modes):
        _replace_stack([m for m in modes if not getattr(m, "done", False)])
