"""BandedToeplitz: a b-banded lower-triangular Toeplitz strategy matrix C for matrix-factorization DP.

A matrix mechanism privatises the sequence of (clipped, summed) gradients ``x_1..x_n`` as
``x + sigma * C^{-1} z`` with ``z`` i.i.d. standard Gaussian (the factorisation ``A = B C`` of the
workload ``A``; the released ``A x + B z`` is post-processing of ``C x + z``). DP-SGD is ``C = I``.

Here ``C`` is lower-triangular Toeplitz with ``b`` bands: ``C[t, s] = c_{t-s}`` for
``0 <= t - s < b``, zero elsewhere. Every column of ``C`` holds (a prefix of) ``c_0..c_{b-1}``, so
with ``||c||_2 = 1`` every column norm is at most 1: one participation of a unit moves ``C x`` by at
most the clipping bound (sensitivity 1 per participation). Under b-min-separated participation the
participations of one unit touch disjoint row blocks of C, which is what the amplification theorem
(:mod:`dptorch.noise.banded.accounting`) needs.

``C^{-1}`` is lower-triangular Toeplitz too: its first column ``d`` is the power series of
``1 / c(x)`` (``c(x) = sum_k c_k x^k``) truncated to n terms. Pure tensor code, differentiable.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

#: Tolerance on ``||c||_2 <= 1`` (column norms normalised to 1).
NORM_TOLERANCE = 1e-9


def _polymul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Coefficients of the product of two polynomials (FFT convolution, float64)."""
    size = a.numel() + b.numel() - 1
    if min(a.numel(), b.numel()) <= 32:  # direct convolution: exact and cheap for short factors
        short, long_ = (a, b) if a.numel() <= b.numel() else (b, a)
        out = torch.zeros(size, dtype=long_.dtype, device=long_.device)
        for k in range(short.numel()):
            out = out + torch.nn.functional.pad(short[k] * long_, (k, size - long_.numel() - k))
        return out
    nfft = 1 << (size - 1).bit_length()
    return torch.fft.irfft(torch.fft.rfft(a, nfft) * torch.fft.rfft(b, nfft), nfft)[:size]


def series_inverse(coefficients: torch.Tensor, n: int) -> torch.Tensor:
    """First ``n`` coefficients of ``1 / c(x)``: the first column of ``C^{-1}`` (Newton doubling).

    ``d <- d (2 - c d) mod x^{2m}`` doubles the number of correct terms at each round.
    """
    c = coefficients
    if c[0] == 0:
        raise ValueError("c_0 must be non-zero (C must be invertible)")
    d = (1.0 / c[0]).reshape(1)
    m = 1
    while m < n:
        m2 = min(2 * m, n)
        cd = _polymul(c[:m2], d)[:m2]
        two_minus = torch.cat([(2.0 - cd[:1]), -cd[1:]])
        d = _polymul(d, two_minus)[:m2]
        m = m2
    return torch.nn.functional.pad(d[:n], (0, n - min(n, d.numel())))  # c = c_0 alone: d stays (1 / c_0, 0, ...)


class BandedToeplitz:
    """The strategy ``C`` given by its band ``c_0..c_{b-1}`` (``bands = b``).

    ``BandedToeplitz.identity()`` is DP-SGD. ``normalised`` is True when ``||c||_2 <= 1`` (every
    column norm of C at most 1, the sensitivity the accounting assumes); the mechanism refuses a
    strategy that is not. ``horizon`` is the number of steps the band was optimised for (None: not
    optimised); the band defines C for any number of steps.
    """

    def __init__(self, coefficients: Sequence[float], horizon: int = None) -> None:
        coefficients = tuple(float(c) for c in coefficients)
        if not coefficients:
            raise ValueError("a banded strategy needs at least one coefficient (c_0)")
        if not all(math.isfinite(c) for c in coefficients):
            raise ValueError(f"strategy coefficients must be finite, got {coefficients}")
        if coefficients[0] == 0:
            raise ValueError("c_0 must be non-zero: C must be invertible")
        self.coefficients: Tuple[float, ...] = coefficients
        self.horizon = None if horizon is None else int(horizon)

    @classmethod
    def identity(cls) -> "BandedToeplitz":
        return cls((1.0,))

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    @property
    def norm(self) -> float:
        """``||c||_2``: the largest column norm of C (all full columns have it)."""
        return math.sqrt(sum(c * c for c in self.coefficients))

    @property
    def normalised(self) -> bool:
        return self.norm <= 1.0 + NORM_TOLERANCE

    def check_normalised(self) -> None:
        if not self.normalised:
            raise ValueError(
                f"the strategy's columns have norm {self.norm:.6g} > 1: one participation would move C x by more than "
                "the clipping bound, which the amplified banded-MF accounting does not cover. Use "
                "BandedToeplitz.normalise(coefficients) (c / ||c||)"
            )

    @classmethod
    def normalise(cls, coefficients: Sequence[float], horizon: int = None) -> "BandedToeplitz":
        c = torch.tensor([float(x) for x in coefficients], dtype=torch.float64)
        return cls((c / c.norm()).tolist(), horizon)

    def tensor(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.tensor(self.coefficients, dtype=dtype)

    def matrix(self, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Dense ``n x n`` C (for tests and small n)."""
        out = torch.zeros(n, n, dtype=dtype)
        for k, c in enumerate(self.coefficients[:n]):
            out += torch.diag(torch.full((n - k,), c, dtype=dtype), -k)
        return out

    def inverse_coefficients(self, n: int) -> torch.Tensor:
        """First column of ``C^{-1}`` (n entries): C^{-1} is Toeplitz with these coefficients."""
        return series_inverse(self.tensor(), n)

    def column_norms(self, n: int) -> torch.Tensor:
        """Column norms of the n x n C (the last b-1 columns are truncated, so no larger)."""
        prefix = torch.cumsum(self.tensor() ** 2, 0)  # prefix[k] = c_0^2 + ... + c_k^2
        rows = torch.clamp(n - torch.arange(n), max=self.bands)  # entries of column j: min(b, n - j)
        return prefix[rows - 1].sqrt()

    def as_dict(self):
        return {"bands": self.bands, "coefficients": list(self.coefficients), "horizon": self.horizon}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BandedToeplitz) and other.coefficients == self.coefficients

    def __hash__(self) -> int:
        return hash(self.coefficients)

    def __repr__(self) -> str:
        shown = ", ".join(f"{c:.4g}" for c in self.coefficients[:6]) + (", ..." if self.bands > 6 else "")
        return f"BandedToeplitz(bands={self.bands}, c=[{shown}], horizon={self.horizon})"
