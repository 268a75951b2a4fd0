"""Expanded weights (``grad_sample_mode="ew"``): per-sample gradients computed by torch itself.

During the root forward every trainable parameter is replaced by an ``ExpandedWeight``
(``torch.nn.utils._expanded_weights``, the mechanism behind ``call_for_per_sample_grads``);
torch's own backward formulas then write ``param.grad_sample``. The model is called as usual,
keyword arguments included, and is not wrapped. Only the layer types torch supports can take
part, and their subclasses whose own ``forward`` expanded weights follow (checked once per class
on a probe); anything else is refused at attach time with the module's name.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

import torch
from torch import nn
from torch.nn.utils._expanded_weights import ExpandedWeight
from torch.nn.utils.stateless import _reparametrize_module

from dptorch.grad_sample.layers.registry import matches_torch_func, overrides_forward, registered_probe
from dptorch.grad_sample.layers.checks import Incompatibility

SUPPORTED = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm, nn.GroupNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)


_FOLLOWS_FORWARD: Dict[type, bool] = {}


def unsupported_modules(model: nn.Module) -> List[Incompatibility]:
    """Modules with trainable direct parameters that expanded weights cannot handle.

    A subclass of a supported layer that overrides ``forward`` is accepted when its forward runs
    under expanded weights and gives torch.func's per-sample gradients on a probe (once per class):
    expanded weights follow each functional call, so they are exact wherever they run at all, but
    an operation they have no rule for (``weight * mask``) fails only inside the training forward.
    """
    found = []
    for path, module in model.named_modules():
        trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if not trainable:
            continue
        if not isinstance(module, SUPPORTED):
            found.append(Incompatibility(
                path, type(module).__name__,
                "expanded weights have no per-sample rule for the operations this module applies to its "
                "parameters; use grad_sample_mode='hooks' (or 'bk'), which handle it",
            ))
        elif isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
            found.append(Incompatibility(
                path, type(module).__name__,
                "scale_grad_by_freq=True: torch's expanded weights ignore it, so the per-sample gradients would not "
                "be the layer's; use grad_sample_mode='hooks' (or 'bk'), which scale by each sample's own counts",
            ))
        elif not _follows_forward(module):
            found.append(Incompatibility(
                path, type(module).__name__,
                "its class overrides forward with operations on its parameters that expanded weights cannot "
                "follow per sample; use grad_sample_mode='hooks' (or 'bk'), which handle it",
            ))
    return found


def _follows_forward(module: nn.Module) -> bool:
    """Whether expanded weights give exact per-sample gradients through ``module``'s own forward."""
    base = next(cls for cls in type(module).__mro__ if cls in SUPPORTED)
    if not overrides_forward(type(module), base):
        return True
    if type(module) not in _FOLLOWS_FORWARD:
        probe = registered_probe(base)
        _FOLLOWS_FORWARD[type(module)] = probe is not None and matches_torch_func(module, probe, sampler=_expanded_grad_samples)
    return _FOLLOWS_FORWARD[type(module)]


def _expanded_grad_samples(module: nn.Module, inputs: Tuple[torch.Tensor, ...], backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``module``'s direct parameters from expanded weights (a probe sampler)."""
    params = {name: p for name, p in module._parameters.items() if p is not None}
    expanded_params = {name: ExpandedWeight(p, backprops.shape[0], "sum") for name, p in params.items()}
    with _reparametrize_module(module, expanded_params):
        output = module.forward(*inputs)
    (output * backprops).sum().backward()
    grads = {p: p.__dict__.pop("grad_sample") for p in params.values()}
    for p in params.values():
        p.grad = None
    return grads


def expanded(model: nn.Module, batch_size: int, loss_reduction: str) -> contextlib.AbstractContextManager:
    """A context in which ``model``'s trainable parameters are expanded weights of ``batch_size``."""
    params = {name: ExpandedWeight(p, batch_size, loss_reduction) for name, p in model.named_parameters() if p.requires_grad}
    return _reparametrize_module(model, params, tie_weights=True)


def zero_padding_rows(model: nn.Module, grad_samples: Dict[nn.Parameter, torch.Tensor]) -> None:
    """Zero, in place, the ``padding_idx`` row of each ``nn.Embedding``'s per-sample gradients.

    torch's expanded weights scatter the output gradient of padding positions into the padding
    row, which torch's own layer (and every sampler here) leaves at zero: without this, a padded
    batch gives that row a per-sample gradient, inflating the norms and moving the padding row.
    """
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            grad = grad_samples.get(module.weight)
            if grad is not None:
                grad[:, module.padding_idx] = 0
