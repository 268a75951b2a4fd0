"""Expanded weights (``grad_sample_mode="ew"``): per-sample gradients computed by torch itself.

During the root forward every trainable parameter is replaced by an ``ExpandedWeight``
(``torch.nn.utils._expanded_weights``, the mechanism behind ``call_for_per_sample_grads``);
torch's own backward formulas then write ``param.grad_sample``. The model is called as usual,
keyword arguments included, and is not wrapped. Only the layer types torch supports can take
part; anything else is refused at attach time with the module's name.
"""

from __future__ import annotations

import contextlib
from typing import List

from torch import nn
from torch.nn.utils._expanded_weights import ExpandedWeight
from torch.nn.utils.stateless import _reparametrize_module

from dptorch.grad_sample.validation import Incompatibility

SUPPORTED = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm, nn.GroupNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)


def unsupported_modules(model: nn.Module) -> List[Incompatibility]:
    """Modules with trainable direct parameters that expanded weights cannot handle."""
    found = []
    for path, module in model.named_modules():
        trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if trainable and not isinstance(module, SUPPORTED):
            found.append(Incompatibility(
                path, type(module).__name__,
                "expanded weights have no per-sample rule for the operations this module applies to its "
                "parameters; use grad_sample_mode='hooks' (or 'bk'), which handle it",
            ))
    return found


def expanded(model: nn.Module, batch_size: int, loss_reduction: str) -> contextlib.AbstractContextManager:
    """A context in which ``model``'s trainable parameters are expanded weights of ``batch_size``."""
    params = {name: ExpandedWeight(p, batch_size, loss_reduction) for name, p in model.named_parameters() if p.requires_grad}
    return _reparametrize_module(model, params, tie_weights=True)
