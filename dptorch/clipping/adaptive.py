"""Adaptive clipping (Andrew et al. 2021): the bound follows a quantile of the norms, privately.

At every logical step each unit reports whether its norm is within the current bound ``C``:
``b_i = 1[||g_i|| <= C]``. The optimizer releases the centred count ``sum_i (b_i - 1/2)`` plus
Gaussian noise of std ``sigma_b`` (``unclipped_num_std``) once per logical step, estimates the
unclipped fraction ``b = (noised count) / m + 1/2`` (``m``: the expected logical batch size) and
moves the bound geometrically towards the target quantile ``gamma``:

    C <- clamp(C * exp(-eta_C * (b - gamma)), min_clipbound, max_clipbound)

Privacy: under add/remove adjacency one unit moves the centred count by 1/2, so the count is a
Gaussian query of noise multiplier ``2 sigma_b``; the clipped sum is one of multiplier
``sigma_grad``. Both read the same Poisson batch, and two Gaussian queries on one batch compose
exactly into one Gaussian query of multiplier ``(sigma_grad^-2 + (2 sigma_b)^-2)^-1/2``. To keep
the stated ``noise_multiplier`` sigma for the whole step, the gradient noise is raised to

    sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^-1/2

(Andrew et al., Theorem 1), which needs ``2 sigma_b > sigma``; other settings are refused. The
accountant then records one subsampled Gaussian of multiplier sigma per step, as for flat
clipping. Private clipping statistics (``clipping_stats="private"``) release the same noised
count and cost the same (once, when adaptive clipping already releases it).

Counting the centred ``b_i - 1/2`` (sensitivity 1/2) rather than ``b_i`` (sensitivity 1) is what
the factor 2 in the formula assumes. A unit whose gradient is not finite is dropped (it contributes
zero to the update): it adds 0 to the centred count and 1/2 to a second coordinate, the count of
dropped units, released (noised alike) only with private statistics. Every unit's vector has norm
1/2, so the released pair costs what the count alone cost.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

#: ``unclipped_num_std`` defaults to the expected batch size divided by this (Andrew et al.: m / 20).
DEFAULT_COUNT_STD_DIVISOR = 20.0
#: ``clipping_stats`` values: None (off), "raw" (exact, not covered by epsilon), "private" (noised, accounted).
CLIPPING_STATS = (None, "raw", "private")
_ADAPTIVE_OPTIONS = ("target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound", "min_clipbound")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class AdaptiveClipping:
    """How the bound moves: target quantile, learning rate and the range it stays in (Opacus' names).

    ``max_clipbound`` defaults to no upper limit, ``min_clipbound`` to 0 (the geometric update never
    reaches 0). Andrew et al. use ``target_unclipped_quantile=0.5`` and ``clipbound_learning_rate=0.2``.
    """

    target_unclipped_quantile: float = 0.5
    clipbound_learning_rate: float = 0.2
    max_clipbound: float = math.inf
    min_clipbound: float = 0.0

    def __post_init__(self) -> None:
        if not (_finite(self.target_unclipped_quantile) and 0 <= self.target_unclipped_quantile <= 1):
            raise ValueError(f"target_unclipped_quantile must be in [0, 1], got {self.target_unclipped_quantile!r}")
        if not (_finite(self.clipbound_learning_rate) and self.clipbound_learning_rate >= 0):
            raise ValueError(f"clipbound_learning_rate must be a finite number >= 0, got {self.clipbound_learning_rate!r}")
        low, high = self.min_clipbound, self.max_clipbound
        if not (_finite(low) and low >= 0):
            raise ValueError(f"min_clipbound must be a finite number >= 0, got {low!r}")
        if not (isinstance(high, (int, float)) and high > low and not math.isnan(high)):
            raise ValueError(f"max_clipbound must be > min_clipbound ({low}), got {high!r}")

    def check_initial(self, max_grad_norm: float) -> None:
        """The starting bound (``max_grad_norm``) must lie in ``[min_clipbound, max_clipbound]``."""
        if not (self.min_clipbound <= max_grad_norm <= self.max_clipbound):
            raise ValueError(
                f"adaptive clipping starts at max_grad_norm={max_grad_norm:g}, outside [min_clipbound, max_clipbound] "
                f"= [{self.min_clipbound:g}, {self.max_clipbound:g}]"
            )

    def next_bound(self, bound: float, unclipped_fraction: float) -> float:
        """``clamp(C exp(-eta_C (b - target)), min, max)``; ``b`` is the noised unclipped fraction."""
        exponent = -self.clipbound_learning_rate * (unclipped_fraction - self.target_unclipped_quantile)
        moved = bound * math.exp(max(min(exponent, 700.0), -700.0))
        return float(min(max(moved, self.min_clipbound), self.max_clipbound))

    def as_dict(self) -> Dict[str, Optional[float]]:
        """Plain values for reports (an infinite ``max_clipbound`` as None, so it is valid JSON)."""
        values = asdict(self)
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in values.items()}


def gradient_noise_multiplier(noise_multiplier: float, unclipped_num_std: Optional[float]) -> float:
    """``sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^-1/2``: the gradient's share of a step of multiplier sigma.

    ``unclipped_num_std=None`` (no count released): sigma. ``noise_multiplier=0``: 0 (nothing is
    private). Raises ``ValueError`` when ``2 sigma_b <= sigma``: the count alone would then spend
    the whole step's budget or more.
    """
    sigma = float(noise_multiplier)
    if unclipped_num_std is None or sigma == 0:
        return sigma
    count_multiplier = 2.0 * float(unclipped_num_std)
    if not count_multiplier > sigma:
        raise ValueError(
            f"noise_multiplier must be smaller than 2 * unclipped_num_std: adaptive clipping (or private clipping "
            f"statistics) with noise_multiplier={sigma:g} needs unclipped_num_std > noise_multiplier / 2 = {sigma / 2:g}, "
            f"got {unclipped_num_std:g}: the noised count "
            f"of unclipped units (sensitivity 1/2) alone would spend a step's whole budget. Raise unclipped_num_std "
            "(default: expected batch size / 20, so a larger batch), or lower the noise multiplier"
        )
    return (sigma**-2 - count_multiplier**-2) ** -0.5


def composed_noise_multiplier(gradient_multiplier: float, unclipped_num_std: Optional[float]) -> float:
    """The one Gaussian multiplier equivalent to the gradient query and the count query together."""
    if unclipped_num_std is None:
        return float(gradient_multiplier)
    return (float(gradient_multiplier) ** -2 + (2.0 * float(unclipped_num_std)) ** -2) ** -0.5


def default_unclipped_num_std(expected_batch_size: float) -> float:
    """Andrew et al.'s choice: the expected batch size / 20."""
    return float(expected_batch_size) / DEFAULT_COUNT_STD_DIVISOR


def unclipped_fraction(noised_centred_count: float, expected_batch_size: float) -> float:
    """The estimate ``(sum_i (b_i - 1/2) + noise) / m + 1/2`` (may leave [0, 1]: it is noised)."""
    return float(noised_centred_count) / float(expected_batch_size) + 0.5


def clipping_plan_fields(
    clipping: str,
    *,
    gamma: Optional[float] = None,
    target_unclipped_quantile: Optional[float] = None,
    clipbound_learning_rate: Optional[float] = None,
    max_clipbound: Optional[float] = None,
    min_clipbound: Optional[float] = None,
    unclipped_num_std: Optional[float] = None,
    clipping_stats: Optional[str] = None,
) -> Dict[str, Any]:
    """The ``PrivacyPlan`` fields of the clipping options (``gamma``, ``adaptive``, ``unclipped_num_std``,
    ``clipping_stats``); refuses an option the clipping mode does not use, so that none is silently ignored."""
    adaptive_given = {
        name: value
        for name, value in zip(_ADAPTIVE_OPTIONS, (target_unclipped_quantile, clipbound_learning_rate,
                                                   max_clipbound, min_clipbound))
        if value is not None
    }
    if gamma is not None and clipping != "automatic":
        raise ValueError(f"gamma is an option of clipping='automatic', not of clipping={clipping!r}")
    if adaptive_given and clipping != "adaptive":
        raise ValueError(f"{', '.join(adaptive_given)}: options of clipping='adaptive', not of clipping={clipping!r}")
    if clipping_stats not in CLIPPING_STATS:
        raise ValueError(f"clipping_stats must be one of {CLIPPING_STATS}, got {clipping_stats!r}")
    if unclipped_num_std is not None:
        if clipping != "adaptive" and clipping_stats != "private":
            raise ValueError(
                "unclipped_num_std is the noise of the count of unclipped units, released only with "
                "clipping='adaptive' or clipping_stats='private'"
            )
        if not (_finite(unclipped_num_std) and unclipped_num_std > 0):
            raise ValueError(f"unclipped_num_std must be a finite number > 0, got {unclipped_num_std!r}")
    fields: Dict[str, Any] = {"clipping_stats": clipping_stats, "unclipped_num_std": unclipped_num_std}
    if clipping == "automatic":
        fields["gamma"] = gamma
    if clipping == "adaptive":
        fields["adaptive"] = AdaptiveClipping(**adaptive_given)
    return fields


__all__ = [
    "AdaptiveClipping",
    "CLIPPING_STATS",
    "clipping_plan_fields",
    "composed_noise_multiplier",
    "default_unclipped_num_std",
    "gradient_noise_multiplier",
    "unclipped_fraction",
]
