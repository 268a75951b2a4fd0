"""``opacus.grad_sample.grad_sample_module_fast_gradient_clipping``: Opacus' fast-gradient-clipping classes,
the controller and the wrapper in ghost mode, under Opacus' names.

``GradSampleHooksFastGradientClipping(model, max_grad_norm=, use_ghost_clipping=)`` is a
:class:`GradSampleHooks` in ``grad_sample_mode="ghost"`` (norms without per-sample gradients), or with
``use_ghost_clipping=False`` in ``"hooks"`` (per-sample gradients instantiated, Opacus' "fast gradient
clipping"); ``GradSampleModuleFastGradientClipping`` wraps a model around one. Both keep
``max_grad_norm`` for Opacus' ``get_norm_sample()`` and ``get_clipping_coef()``; the clipping of a
training step is the DP optimizer's, one backward pass in every mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptorch.clipping.factors import clip_factors, flat_norms
from dptorch.grad_sample import GradSampleHooks, GradSampleModule


def _fast_clipping_options(max_grad_norm: float, use_ghost_clipping: bool, options: dict) -> dict:
    if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a number > 0, got {max_grad_norm!r}")
    mode = options.pop("grad_sample_mode", None) or ("ghost" if use_ghost_clipping else "hooks")
    return dict(options, grad_sample_mode=mode)


class GradSampleHooksFastGradientClipping(GradSampleHooks):
    """The controller in ghost mode (``use_ghost_clipping=False``: hooks mode), keeping ``max_grad_norm``."""

    def __init__(self, module: nn.Module, *, max_grad_norm: float = 1.0, use_ghost_clipping: bool = True,
                 **options: Any) -> None:
        super().__init__(module, **_fast_clipping_options(max_grad_norm, use_ghost_clipping, options))
        self.max_grad_norm = float(max_grad_norm)
        self.use_ghost_clipping = use_ghost_clipping

    def get_norm_sample(self) -> torch.Tensor:
        """Each sample's gradient norm over all parameters, for the last backward pass."""
        return flat_norms(self.per_sample_norms()).to(torch.float32)

    def get_clipping_coef(self) -> torch.Tensor:
        """Each sample's clip factor ``min(1, max_grad_norm / norm)`` (the DP optimizer's rule)."""
        return clip_factors(flat_norms(self.per_sample_norms()), self.max_grad_norm)


class GradSampleModuleFastGradientClipping(GradSampleModule):
    """A :class:`GradSampleModule` holding a :class:`GradSampleHooksFastGradientClipping` controller."""

    hooks_class = GradSampleHooksFastGradientClipping

    @property
    def max_grad_norm(self) -> float:
        return self.hooks.max_grad_norm

    def get_norm_sample(self) -> torch.Tensor:
        """See :meth:`GradSampleHooksFastGradientClipping.get_norm_sample`."""
        return self.hooks.get_norm_sample()

    def get_clipping_coef(self) -> torch.Tensor:
        """See :meth:`GradSampleHooksFastGradientClipping.get_clipping_coef`."""
        return self.hooks.get_clipping_coef()


__all__ = ["GradSampleHooksFastGradientClipping", "GradSampleModuleFastGradientClipping"]
