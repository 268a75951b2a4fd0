"""What the controller is set to do (``Settings``) and whether it captures now (``Switches``), shared by
its collaborators."""

from __future__ import annotations

import contextlib
from typing import Dict

import torch
from torch import nn


class Settings:
    """The controller's options: fixed at attach, except ``keep_param_grads``, which the DP optimizer
    turns off (``GradSampleHooks`` reads and writes them here)."""

    def __init__(self, batch_first: bool, loss_reduction: str, grad_sample_mode: str, keep_param_grads: bool) -> None:
        self.batch_dim = 0 if batch_first else 1
        self.loss_reduction = loss_reduction
        self.grad_sample_mode = grad_sample_mode
        self.keep_param_grads = keep_param_grads

    @property
    def suppressing(self) -> bool:
        """Whether hooked layers keep their own parameters out of autograd during their calls.

        Then any autograd gradient that reaches a parameter came by a path the controller does not
        see (a weight read outside its module, a penalty on it in the loss) and is refused. Under
        DDP too: DDP's gradient sync is then off for the forward (the DP optimizer all-reduces the
        clipped sums). Expanded weights need the parameters in the graph.
        """
        return not self.keep_param_grads and self.grad_sample_mode != "ew"

    def per_sample_scale(self, grad: torch.Tensor, n: int) -> torch.Tensor:
        """``grad`` as the gradient of each sample's own loss (a mean loss divided it by ``n``)."""
        return grad * n if self.loss_reduction == "mean" else grad


class Switches:
    """Whether capture is on: paused by the user (``disable_hooks()``), or stepped aside while the
    controller re-runs a recorded call in backward or runs operations of its own."""

    def __init__(self) -> None:
        self.paused = False  # disable_hooks(): no capture at all until enable_hooks()
        self.paused_gradients: Dict[nn.Parameter, None] = {}  # parameters a paused backward gave a gradient
        self.replaying = False  # inside replay()
        self.suspending = False  # inside capture_suspended(): our own operations

    @contextlib.contextmanager
    def replay(self):
        """Our own re-run of a recorded layer call in backward: the hooked layers inside it capture nothing."""
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False

    @contextlib.contextmanager
    def capture_suspended(self):
        self.suspending = True
        try:
            yield
        finally:
            self.suspending = False

    @property
    def suspended(self) -> bool:
        """Whether backward-side capture is off: our own operations, or capture paused."""
        return self.suspending or self.paused
