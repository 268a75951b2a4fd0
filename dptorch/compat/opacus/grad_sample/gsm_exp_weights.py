"""``opacus.grad_sample.gsm_exp_weights``: ``GradSampleModuleExpandedWeights``, a :class:`GradSampleModule`
in ``grad_sample_mode="ew"`` (torch's expanded weights compute the per-sample gradients)."""

from typing import Any

from torch import nn

from dptorch.compat.opacus import GradSampleModule


class GradSampleModuleExpandedWeights(GradSampleModule):
    """``GradSampleModule(module, grad_sample_mode="ew", ...)`` under Opacus' class name."""

    def __init__(self, module: nn.Module, **options: Any) -> None:
        super().__init__(module, **dict(options, grad_sample_mode="ew"))


__all__ = ["GradSampleModuleExpandedWeights"]
