"""Optimising a banded Toeplitz strategy for the prefix-sum workload.

The workload of SGD on the noise is the prefix sum ``A`` (lower-triangular ones): the model after
t steps holds ``sum_{s <= t}`` of the noised gradients. With ``x + C^{-1} z`` released, the error of
every prefix is ``A C^{-1} z``, whose expected total squared norm is ``||A C^{-1}||_F^2``. ``A`` and
``C^{-1}`` are lower-triangular Toeplitz, so ``A C^{-1}`` is too, with first column ``e = cumsum(d)``
(``d`` the first column of ``C^{-1}``), and

    ||A C^{-1}||_F^2 = sum_{k=0}^{n-1} (n - k) e_k^2.

We minimise it over the band ``c_0..c_{b-1}`` with ``||c||_2 = 1`` (column norms normalised: the
sensitivity per participation is 1), parametrising ``c = theta / ||theta||`` and running L-BFGS on
the log of the error from the closed-form start: the coefficients of ``(1 - x)^{-1/2}`` (the square
root of A, optimal among Toeplitz factorisations as b grows: Fichtenberger, Henzinger and Upadhyay
2023), truncated to b bands. ``b = 1`` is the identity (DP-SGD), error ``n (n + 1) / 2``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Tuple

import torch

from dptorch.noise_mechanisms.banded import BandedToeplitz, series_inverse


def prefix_sum_error(coefficients: torch.Tensor, n: int) -> torch.Tensor:
    """``||A C^{-1}||_F^2`` for the n-step prefix-sum workload and the band ``coefficients``."""
    e = torch.cumsum(series_inverse(coefficients, n), 0)
    weights = torch.arange(n, 0, -1, dtype=e.dtype, device=e.device)
    return (weights * e * e).sum()


def square_root_start(bands: int) -> torch.Tensor:
    """``(1 - x)^{-1/2}`` truncated to ``bands`` terms: r_0 = 1, r_k = r_{k-1} (2k - 1) / (2k)."""
    r = [1.0]
    for k in range(1, bands):
        r.append(r[-1] * (2 * k - 1) / (2 * k))
    return torch.tensor(r, dtype=torch.float64)


@lru_cache(maxsize=64)
def _optimal_band(n: int, bands: int, max_iter: int) -> Tuple[float, ...]:
    if bands == 1:
        return (1.0,)
    theta = square_root_start(bands)
    theta = (theta / theta.norm()).clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([theta], lr=1.0, max_iter=max_iter, history_size=20,
                                  tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.log(prefix_sum_error(theta / theta.norm(), n))
        if not torch.isfinite(loss):
            return loss
        loss.backward()
        return loss

    start = square_root_start(bands)
    start_error = float(prefix_sum_error(start / start.norm(), n))
    optimizer.step(closure)
    with torch.no_grad():
        c = theta / theta.norm()
        if c[0] < 0:
            c = -c  # the error is invariant to the sign; keep c_0 > 0
        error = float(prefix_sum_error(c, n))
    if not (error <= start_error) or not torch.isfinite(c).all():
        c = start / start.norm()  # never worse than the closed-form start
    return tuple(float(v) for v in c)


def optimal_banded_strategy(n: int, bands: int, max_iter: int = 200) -> BandedToeplitz:
    """The b-banded Toeplitz C (``||c|| = 1``) minimising the n-step prefix-sum error; cached by (n, b).

    ``bands`` is capped at ``n`` (more bands than steps change nothing).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of steps n must be a whole number >= 1, got {n!r}")
    if not isinstance(bands, int) or isinstance(bands, bool) or bands < 1:
        raise ValueError(f"bands must be a whole number >= 1, got {bands!r}")
    return BandedToeplitz(_optimal_band(n, min(bands, n), max_iter), horizon=n)
