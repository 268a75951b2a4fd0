"""Certified per-sample norms: a rigorous bound on the rounding of a norm formed by a cancelling sum.

Book-keeping and ghost norms never instantiate a per-sample gradient ``G = sum_t b_t a_t^T``: they
form ``||G||^2`` as a sum whose terms can cancel (the Gram sum ``sum_{t,s} (a_t.a_s)(b_t.b_s)``,
output gradients summed over the tokens of one embedding row, the cross terms of a parameter's
several uses). In floating point such a sum can come out far below the true value (two identical
tokens with output gradients ``K u`` and ``-K u + delta`` give exactly 0 in float32), and the clipped
sum, itself a float32 sum over the same tokens, adds for the sample more than ``c ||G||``.

Both roundings are bounded by the standard error bound of a sum of products (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., Lemma 3.1 and eq. (3.5); it holds for any order of
summation, blocked or fused): a sum whose every term undergoes at most ``n`` roundings in a dtype
of unit roundoff ``u`` is off by at most ``gamma_n * sum |terms|``, ``gamma_n = n u / (1 - n u)``.
For ``G`` every such ``sum |terms|`` is at most ``M^2`` (or ``M`` for the clipped sum, entry by
entry), with the magnitude ``M = sum_t ||a_t|| ||b_t||`` (Cauchy-Schwarz). Hence

    ||G||   <= sqrt(max(computed, 0) + gamma_n M^2)            (the norm's rounding)
    ||sum|| <= c (||G|| + gamma_m M)                           (the clipped sum's rounding)

and ``certified_norms_sq`` returns the square of ``sqrt(max(computed, 0) + gamma_n M^2) + gamma_m M``:
a clip factor formed from it keeps what is summed for the sample within ``C``, provided the sample's terms
are summed among themselves (``m`` counts its own tokens): every clipped sum adds each sample's tokens on
their own before samples meet (``linear_forms.token_sums``). Norms are formed in
float64 (``wide_dtype``), so on ordinary data the bound moves a norm by about ``(T + 4) u sqrt(T)``
(float32 ``u``; the clipped sum's worst case): 9e-5 relative at T = 128, 7e-4 at T = 512.
"""

from __future__ import annotations

from typing import Optional

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: half the distance from 1 to the next number of ``dtype`` (2^-24 for float32)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """``n u / (1 - n u)``: the relative bound of ``n`` roundings in ``dtype``; infinite when ``n u >= 1``."""
    nu = n * unit_roundoff(dtype)
    return nu / (1 - nu) if nu < 1 else float("inf")


def wide_dtype(device: torch.device) -> torch.dtype:
    """float64, or float32 on devices without it (MPS): the dtype certified norms are formed in."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def magnitudes(left: Optional[torch.Tensor], right: torch.Tensor) -> torch.Tensor:
    """``M_i = sum_t ||left_it|| ||right_it||`` for ``(B, T, *)`` factors, rounded up; ``left=None``
    stands for ones (a bias: ``sum_t ||right_it||``). Wide dtype, shape ``(B,)``."""
    dtype = wide_dtype(right.device)
    per_token = torch.linalg.vector_norm(right.flatten(2), dim=2, dtype=dtype)
    terms = right.shape[-1] + right.shape[1] + 1
    if left is not None:
        per_token = per_token * torch.linalg.vector_norm(left.flatten(2), dim=2, dtype=dtype)
        terms += left.shape[-1] + 1
    return per_token.sum(1) * (1 + gamma(terms + 2, dtype))  # non-negative terms: a relative bound


def certified_norms_sq(
    computed_sq: torch.Tensor,
    magnitude: torch.Tensor,
    *,
    norm_terms: int = 0,
    norm_dtype: Optional[torch.dtype] = None,
    sum_terms: int,
    sum_dtype: torch.dtype,
) -> torch.Tensor:
    """``(sqrt(max(computed_sq, 0) + gamma(norm_terms) M^2) + gamma(sum_terms) M)^2`` per sample.

    ``computed_sq`` was formed in ``norm_dtype`` with at most ``norm_terms`` roundings per term
    (``norm_terms=0``: ``computed_sq`` is already an upper bound, ``exact_products``); the clipped sum runs in ``sum_dtype`` with at most ``sum_terms`` roundings per term (the
    factor's application included). Returned in the wide dtype (an upper bound: it is rounded up).
    """
    dtype = wide_dtype(magnitude.device)
    m = magnitude.to(dtype)
    computed = computed_sq.to(dtype).clamp(min=0)
    if norm_terms:
        computed = computed + gamma(norm_terms, norm_dtype) * m.square()
    norm = computed.sqrt() + gamma(sum_terms, sum_dtype) * m
    return norm.square() * (1 + gamma(6, dtype))  # this function's own few roundings
