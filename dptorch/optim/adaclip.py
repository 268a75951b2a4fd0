"""``AdaClipDPOptimizer``: adaptive clipping built the way Opacus users build it.

Same keyword names as ``opacus.optimizers.AdaClipDPOptimizer`` (``noise_multiplier``,
``max_grad_norm`` as the starting bound, ``expected_batch_size``, ``target_unclipped_quantile``,
``clipbound_learning_rate``, ``max_clipbound``, ``min_clipbound``, ``unclipped_num_std``), plus
dptorch's ``hooks=`` (the per-sample gradient controller). It is a :class:`DPOptimizer` with
``clipping="adaptive"``, so it works in every grad sample mode (hooks, bk, ghost), with virtual
steps and ``BatchMemoryManager``; ``make_private(clipping="adaptive", ...)`` builds the same thing.

Differences from Opacus, on purpose: the released count is centred (``b_i - 1/2``, sensitivity
1/2, which the ``(2 sigma_b)^-2`` term of the noise formula assumes), ``noise_multiplier`` stays
the stated sigma that the accountant records (``plan.gradient_noise_multiplier`` is the raised one
the gradient gets), and the settings Opacus leaves required have the paper's defaults.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from dptorch.optim.optimizer import DPOptimizer


class AdaClipDPOptimizer(DPOptimizer):
    """A :class:`DPOptimizer` with ``clipping="adaptive"`` (Andrew et al. 2021); see the module docstring."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: Optional[float] = None,
        max_grad_norm: Optional[float] = None,
        expected_batch_size: Optional[float] = None,
        target_unclipped_quantile: float = 0.5,
        clipbound_learning_rate: float = 0.2,
        max_clipbound: float = math.inf,
        min_clipbound: float = 0.0,
        unclipped_num_std: Optional[float] = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("plan") is not None:
            super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                             expected_batch_size=expected_batch_size, **kwargs)
            if self.clipping != "adaptive":
                raise ValueError(f"AdaClipDPOptimizer needs a plan with clipping='adaptive', got {self.clipping!r}")
            return
        clipping = kwargs.pop("clipping", "adaptive")
        if clipping != "adaptive":
            raise ValueError(f"AdaClipDPOptimizer clips adaptively; got clipping={clipping!r}")
        generator = kwargs.pop("generator", None)  # Opacus' name for the noise generator
        if generator is not None:
            kwargs.setdefault("noise_generator", generator)
        super().__init__(
            optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size, clipping="adaptive",
            target_unclipped_quantile=target_unclipped_quantile, clipbound_learning_rate=clipbound_learning_rate,
            max_clipbound=max_clipbound, min_clipbound=min_clipbound, unclipped_num_std=unclipped_num_std, **kwargs,
        )


__all__ = ["AdaClipDPOptimizer"]
