"""``opacus.optimizers.optimizer``: DPOptimizer (implementation: dptorch.optim.optimizer), and Opacus'
``_generate_noise`` on dptorch's Gaussian noise."""

from __future__ import annotations

from typing import Optional

import torch

from dptorch.compat.opacus import DPOptimizer
from dptorch.noise.gaussian import gaussian_noise


def _generate_noise(std: float, reference: torch.Tensor, generator: Optional[torch.Generator] = None,
                    secure_mode: bool = False) -> torch.Tensor:
    """N(0, std^2) noise shaped like ``reference``, on its device and of its dtype (``std=0``: zeros).

    ``secure_mode=True`` draws from the OS CSPRNG with dptorch's mitigation of floating-point attacks
    (``dptorch.noise.gaussian``) and takes no ``generator`` (refused: a seeded stream is not secure).
    """
    if float(std) == 0.0:
        return torch.zeros_like(reference)
    return gaussian_noise(reference, std, generator=generator, secure=secure_mode).to(reference.dtype)


__all__ = ["DPOptimizer"]
