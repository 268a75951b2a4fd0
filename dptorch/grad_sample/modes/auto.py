"""``grad_sample_mode="auto"``: the exact mode chosen for a model before attaching.

Every mode computes the same clipped sums (each is tested against the batch-of-one oracle); they
differ in cost. Book-keeping (``"bk"``) forms the per-sample norms and the clipped sum of a layer
that has a norm sampler (``nn.Linear``, transformers' ``Conv1D``, ``nn.Embedding``) from its inputs
and output gradients, without instantiating one gradient per sample, and falls back to the
instantiated per-sample gradients of ``"hooks"`` for every other layer. It holds far less memory
(through ``make_private``: 0.94-1.06x the plain step's peak RSS, hooks 1.4-1.65x on the narrow
shapes). Its ghost norms are certified (float64 products on CPU: ``norms/exact_products.py``), which
costs time: on this project's CPU, through ``make_private``, bk took 1.6-1.7x the plain step on the
narrow shapes where hooks took 1.1-1.3x (docs/performance.md, "Memory through the engine"). Memory
first: a user with memory to spare gets the faster step with ``"hooks"``.

So ``"auto"`` is ``"bk"`` when a trainable parameter belongs to a layer with a norm sampler, else
``"hooks"`` (the same computation then, and Opacus code that reads ``p.grad_sample`` finds it on
every parameter). Under ``"bk"`` only the instantiated parameters have ``p.grad_sample``: pass
``grad_sample_mode="hooks"`` to read per-sample gradients of every parameter.
"""

from __future__ import annotations

from typing import Iterable, Optional

from torch import nn

from dptorch.grad_sample.modes.names import GRAD_SAMPLE_MODES
from dptorch.grad_sample.layers.registry import find_norm_sampler

AUTO = "auto"
#: What ``make_private``, ``PrivacyArguments`` and the examples accept: "auto" and the controller's modes.
MODES = (AUTO,) + tuple(GRAD_SAMPLE_MODES)


def choose_grad_sample_mode(module: nn.Module, params: Optional[Iterable[nn.Parameter]] = None) -> str:
    """``"bk"`` when a trainable parameter (``params``, default: those with ``requires_grad``) is a
    direct parameter of a layer with a norm sampler, else ``"hooks"``."""
    trainable = {id(p) for p in (params if params is not None else module.parameters()) if p.requires_grad}
    for layer in module.modules():
        direct = [p for p in layer.parameters(recurse=False) if id(p) in trainable]
        if direct and find_norm_sampler(layer) is not None:
            return "bk"
    return "hooks"


def resolve_grad_sample_mode(mode: str, module: nn.Module, params: Optional[Iterable[nn.Parameter]] = None) -> str:
    """The mode to run: ``mode`` itself, or for ``"auto"`` the choice of :func:`choose_grad_sample_mode`."""
    if mode not in MODES:
        raise ValueError(f"grad_sample_mode must be one of {MODES}, got {mode!r}")
    return choose_grad_sample_mode(module, params) if mode == AUTO else mode


def describe_mode(requested: str, ran: str) -> str:
    """One line for the logs: which mode runs and why."""
    if requested != AUTO:
        return f"per-sample gradients: grad_sample_mode={ran!r}"
    why = ("book-keeping: a trainable layer has a norm sampler, so no per-sample gradient is instantiated for it"
           if ran == "bk" else "no trainable layer has a norm sampler, so book-keeping would instantiate the same")
    return f"per-sample gradients: grad_sample_mode='auto' runs {ran!r} ({why})"
