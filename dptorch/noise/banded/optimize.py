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

SGD with momentum and a learning-rate schedule has another workload (:class:`SGDWorkload`): the
noise reaches the parameters as ``theta_t = -sum_{s <= t} eta_s m_s`` with ``m_s = beta m_{s-1} +
g_s``, i.e. ``W[t, r] = sum_{s=r}^{t} eta_s beta^{s - r}``. ``optimal_banded_strategy(n, b,
workload=SGDWorkload(momentum=0.9))`` minimises ``||W C^{-1}||_F^2`` instead (same normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import torch

from dptorch.noise.banded.toeplitz import BandedToeplitz, _polymul, series_inverse


def prefix_sum_error(coefficients: torch.Tensor, n: int) -> torch.Tensor:
    """``||A C^{-1}||_F^2`` for the n-step prefix-sum workload and the band ``coefficients``."""
    return _prefix_error_of_series(series_inverse(coefficients, n))


def _prefix_error_of_series(f: torch.Tensor) -> torch.Tensor:
    """``||A T||_F^2`` for the lower-triangular Toeplitz T of first column ``f`` (n terms)."""
    e = torch.cumsum(f, 0)
    weights = torch.arange(len(f), 0, -1, dtype=e.dtype, device=e.device)
    return (weights * e * e).sum()


@dataclass(frozen=True)
class SGDWorkload:
    """The workload of SGD with momentum ``beta`` and relative learning rates ``eta_s`` (None: constant).

    ``W[t, r] = sum_{s=r}^{t} eta_s beta^{s - r}``: how the noise of step r reaches the parameters
    after step t. ``SGDWorkload()`` is the prefix sum. With a schedule the error costs O(n^2).
    """

    momentum: float = 0.0
    learning_rates: Optional[Tuple[float, ...]] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.learning_rates is not None:
            object.__setattr__(self, "learning_rates", tuple(float(v) for v in self.learning_rates))

    def _rates(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        if len(self.learning_rates) < n:
            raise ValueError(f"the workload has {len(self.learning_rates)} learning rates, fewer than the {n} steps")
        return torch.tensor(self.learning_rates[:n], dtype=dtype)

    def error(self, coefficients: torch.Tensor, n: int) -> torch.Tensor:
        """``||W C^{-1}||_F^2`` for the band ``coefficients`` (differentiable)."""
        f = series_inverse(coefficients, n)
        if self.momentum:  # M C^{-1}, M Toeplitz with first column beta^k
            f = _polymul(f, self.momentum ** torch.arange(n, dtype=f.dtype))[:n]
        if self.learning_rates is None:  # W C^{-1} = A M C^{-1}, M C^{-1} Toeplitz: the prefix-sum formula
            return _prefix_error_of_series(f)
        lag = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        scaled = torch.where(lag >= 0, f[lag.clamp(min=0)], torch.zeros((), dtype=f.dtype))
        return torch.cumsum(self._rates(n, f.dtype)[:, None] * scaled, 0).pow(2).sum()

    def matrix(self, n: int) -> torch.Tensor:
        """Dense ``n x n`` W (for tests and small n)."""
        lag = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        momentum = torch.where(lag >= 0, self.momentum ** lag.clamp(min=0).double(), torch.zeros((), dtype=torch.float64))
        rates = torch.ones(n, dtype=torch.float64) if self.learning_rates is None else self._rates(n, torch.float64)
        return torch.tril(torch.ones(n, n, dtype=torch.float64)) @ (rates[:, None] * momentum)


def square_root_start(bands: int) -> torch.Tensor:
    """``(1 - x)^{-1/2}`` truncated to ``bands`` terms: r_0 = 1, r_k = r_{k-1} (2k - 1) / (2k)."""
    r = [1.0]
    for k in range(1, bands):
        r.append(r[-1] * (2 * k - 1) / (2 * k))
    return torch.tensor(r, dtype=torch.float64)


@lru_cache(maxsize=64)
def _optimal_band(n: int, bands: int, max_iter: int, workload: Optional[SGDWorkload]) -> Tuple[float, ...]:
    error_of = prefix_sum_error if workload is None else workload.error
    if bands == 1:
        return (1.0,)
    theta = square_root_start(bands)
    theta = (theta / theta.norm()).clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([theta], lr=1.0, max_iter=max_iter, history_size=20,
                                  tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.log(error_of(theta / theta.norm(), n))
        if not torch.isfinite(loss):
            return loss
        loss.backward()
        return loss

    start = square_root_start(bands)
    start_error = float(error_of(start / start.norm(), n))
    optimizer.step(closure)
    with torch.no_grad():
        c = theta / theta.norm()
        if c[0] < 0:
            c = -c  # the error is invariant to the sign; keep c_0 > 0
        error = float(error_of(c, n))
    if not (error <= start_error) or not torch.isfinite(c).all():
        c = start / start.norm()  # never worse than the closed-form start
    return tuple(float(v) for v in c)


def optimal_banded_strategy(n: int, bands: int, max_iter: int = 200,
                            workload: Optional[SGDWorkload] = None) -> BandedToeplitz:
    """The b-banded Toeplitz C (``||c|| = 1``) minimising the n-step error of ``workload`` (default: the
    prefix sum); cached by (n, b, workload).

    ``bands`` is capped at ``n`` (more bands than steps change nothing).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of steps n must be a whole number >= 1, got {n!r}")
    if not isinstance(bands, int) or isinstance(bands, bool) or bands < 1:
        raise ValueError(f"bands must be a whole number >= 1, got {bands!r}")
    if workload is not None and not workload.momentum and workload.learning_rates is None:
        workload = None  # the prefix sum: share its cache entry
    return BandedToeplitz(_optimal_band(n, min(bands, n), max_iter, workload), horizon=n)
