"""Clip factors: pure functions from per-sample norms to per-sample multipliers.

A factor ``c_i = min(1, C / (||g_i|| (1 + 2^-16) + 1e-6))`` makes ``||c_i g_i|| <= C`` for every
sample. The relative margin ``2^-16`` (256 units of float32 rounding) covers the rounding of the
float32 norms and of the float32 clipped sum, so the bound holds for the contribution as it is
computed, not only in exact arithmetic; it changes no factor by more than 0.002 %. Factors are
computed in float64 (float32 on devices without it) and returned in float32, never in the
parameters' dtype: a bf16 factor could round up by 0.4 %.

Flat clipping uses one norm over all parameters; per-layer clipping one norm and one threshold
per parameter, so that the whole contribution is bounded by ``sqrt(sum_k C_k^2)``.

Automatic clipping (Bu et al. 2022, "AUTO-S"): ``c_i = 1 / (||g_i|| (1 + 2^-16) + gamma)``, so
``||c_i g_i|| < 1`` for every sample: the sensitivity is 1 whatever ``max_grad_norm`` says, and
the noise std is ``noise_multiplier`` (the bound's scale lives in the learning rate).

Adaptive clipping (Andrew et al. 2021) clips flat with a bound ``C`` that the optimizer moves
towards a quantile of the norms between steps (:mod:`dptorch.clipping.adaptive`); its factors are
the flat ones at the current ``C``.

Non-finite units: a unit whose norm is inf or NaN (an inf feature, a ``log(0)`` in its loss term)
gets the factor 0 in every mode (``drop_nonfinite``), and the controller zeroes its rows rather than
multiplying them by 0 (``0 * inf`` is NaN). Whether a unit is dropped depends on that unit's own
data only, so its contribution is still a function of it of norm <= C: the bound holds.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Union

import torch

CLIPPING_MODES = ("flat", "per_layer", "automatic", "adaptive")
#: Modes with one bound for the whole per-sample gradient (a float ``max_grad_norm``).
FLAT_MODES = ("flat", "automatic", "adaptive")
#: gamma of automatic clipping when none is given (Bu et al. 2022 use 0.01).
DEFAULT_GAMMA = 0.01
_STABILITY = 1e-6
ROUNDING_MARGIN = 2.0**-16


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 where the device has it (not MPS), else float32."""
    return t.to(torch.float32 if t.device.type == "mps" else torch.float64)


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """``min(1, C / (norm (1 + 2^-16) + 1e-6))`` elementwise, float32."""
    wide = _wide(norms)
    return (max_grad_norm / (wide * (1.0 + ROUNDING_MARGIN) + _STABILITY)).clamp(max=1.0).to(torch.float32)


def automatic_factors(norms: torch.Tensor, gamma: float = DEFAULT_GAMMA) -> torch.Tensor:
    """``1 / (norm (1 + 2^-16) + gamma)`` elementwise, float32: every ``||c_i g_i|| < 1``."""
    if not (gamma > 0 and math.isfinite(gamma)):
        raise ValueError(f"gamma of automatic clipping must be a finite number > 0, got {gamma!r}")
    wide = _wide(norms)
    return (1.0 / (wide * (1.0 + ROUNDING_MARGIN) + gamma)).to(torch.float32)


class NonFiniteGradientWarning(UserWarning):
    """A unit's gradient was not finite and was dropped (shown once per optimizer; names no unit)."""


def nonfinite_units(total_norms: torch.Tensor) -> torch.Tensor:
    """True for each unit whose norm is inf or NaN: some entry of its gradient is not finite."""
    return ~torch.isfinite(total_norms)


def drop_nonfinite(factors: torch.Tensor, dropped: Optional[torch.Tensor]) -> torch.Tensor:
    """``factors`` with exactly 0 for the ``dropped`` units (``None``: unchanged); an inf norm's
    factor is 0 already, a NaN norm's is NaN, hence ``torch.where``."""
    if dropped is None:
        return factors
    return torch.where(dropped.to(factors.device), factors.new_zeros(()), factors)


def flat_norms(per_param_norms: Dict[object, torch.Tensor]) -> torch.Tensor:
    """One norm per sample over all parameters, from each parameter's per-sample norms.

    Summed in float64 (where the device has it): the sum runs over every parameter tensor of the
    model, hundreds for a transformer.
    """
    return _wide(torch.stack(list(per_param_norms.values()))).pow(2).sum(0).sqrt()


def per_layer_thresholds(params: Sequence[object], max_grad_norm: Union[float, Sequence[float]]) -> Dict[object, float]:
    """Thresholds per parameter: a list as given, or one float split so the total stays ``C``."""
    if isinstance(max_grad_norm, (int, float)):
        share = float(max_grad_norm) / math.sqrt(max(len(params), 1))
        return {p: share for p in params}
    if len(max_grad_norm) != len(params):
        raise ValueError(
            f"per-layer clipping needs one max_grad_norm per trainable parameter: got {len(max_grad_norm)} "
            f"thresholds for {len(params)} parameters"
        )
    return dict(zip(params, (float(c) for c in max_grad_norm)))


def total_norm_bound(clipping: str, max_grad_norm: Union[float, Sequence[float]]) -> float:
    """The bound on one sample's whole clipped contribution (the sensitivity); 1 for automatic clipping."""
    if clipping == "automatic":
        return 1.0
    if clipping in FLAT_MODES or isinstance(max_grad_norm, (int, float)):
        return float(max_grad_norm)
    return math.sqrt(sum(float(c) ** 2 for c in max_grad_norm))
