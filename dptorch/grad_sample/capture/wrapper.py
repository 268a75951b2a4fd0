"""GradSampleModule: an optional wrapper that *holds* a GradSampleHooks controller.

For users who prefer Opacus' wrapping style. It forwards calls and unknown attributes to the
wrapped model, exposes it as ``_module`` and hands it back untouched with
``to_standard_module()``. All capture logic lives in the controller.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from dptorch.grad_sample.capture.hooks import GradSampleHooks


class GradSampleModule(nn.Module):
    """Wrap ``module`` and capture per-sample gradients (keywords as ``GradSampleHooks``)."""

    #: The controller class the wrapper holds (a subclass may hold a subclass).
    hooks_class = GradSampleHooks

    def __init__(self, module: nn.Module, **hooks_kwargs: Any) -> None:
        super().__init__()
        self._module = module
        self.__dict__["hooks"] = self.hooks_class(module, **hooks_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_module"], name)

    @property
    def grad_samples(self) -> Dict[nn.Parameter, torch.Tensor]:
        return self.hooks.grad_samples

    @property
    def hooks_enabled(self) -> bool:
        """Whether the controller captures (Opacus' name)."""
        return self.hooks.hooks_enabled

    def disable_hooks(self) -> None:
        """Pause capture (:meth:`GradSampleHooks.disable_hooks`)."""
        self.hooks.disable_hooks()

    def enable_hooks(self) -> None:
        """Resume capture (:meth:`GradSampleHooks.enable_hooks`)."""
        self.hooks.enable_hooks()

    def remove_hooks(self) -> None:
        """Detach the controller (Opacus' name); the wrapped model is exactly as it was."""
        self.hooks.cleanup()

    def to_standard_module(self) -> nn.Module:
        """Detach the controller and return the wrapped model, exactly as it was."""
        self.hooks.cleanup()
        return self._module
