"""Certified matrix products: a float64 value and a rigorous bound on its error, float32 products allowed.

Ghost norms are sums that can cancel (``certified``), so the products they are built from (the Grams
``a a^T``, ``b b^T``, an instantiated ``b^T a``) are needed far beyond float32's precision. A
``CertifiedProduct`` holds the value of ``x @ y`` (per sample, float64) and a bound on its error of
the form ``|value - x @ y| <= sum_r outer(u_r, v_r)`` entry by entry, from one of two routes:

* ``"float64"``: the product in float64, ``|error| <= gamma_n(float64) |x| |y| <= gamma_n ||x_i|| ||y_j||``.
* ``"split"``: error-free splitting (the Ozaki scheme), float32 matrix products only. Each row of
  ``x`` (column of ``y``) is scaled by a power of two so that its largest entry is below ``2^K``
  (``K = high_bits(n)``) and split exactly into an integer high part ``h`` (``|h| <= 2^K``) and a low part
  ``l`` (``|l| <= 1/2``). Over a block of ``CHUNK`` contraction terms ``h_x h_y`` is a sum of integers of
  magnitude at most ``CHUNK 2^(2K) = 2^24``: every partial sum is an integer that float32 holds
  exactly, so a float32 matmul returns it exactly in any order of summation (also with TF32 or bf16
  inputs: ``h`` has at most 9 significant bits). The rest, ``h_x l_y + l_x (h_y + l_y)``, is one float32
  product of length ``2 CHUNK`` per block, off by at most ``gamma_{2 CHUNK}(u_mm) (|h_x| |l_y| + |l_x| |y|)``,
  where ``|l| ~ 2^-K |x|``: about ``2^-K CHUNK u`` relative to ``|x| |y|`` instead of float32's ``n u``.
  Blocks are summed and rescaled in float64 (exact for the high parts; bounded for the rest).

``products_route`` picks the route: ``"split"`` wherever float64 is a slow lane (accelerators: a
float64 matrix product runs at 1/15 to 1/64 of float32's rate there, and MPS has none), and on CPU
where it measured faster than float64 (``SPLIT_ON_CPU_FROM``); ``use_route`` forces one (tests,
benchmarks).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from dptorch.grad_sample.norms.certified import gamma, unit_roundoff

#: Contraction terms of one exact block: ``high_bits`` keeps ``CHUNK * 2^(2 K) <= 2^24`` (``K = 8`` here,
#: more for shorter products).
CHUNK = 256

#: On CPU the split route is taken for products whose contraction is at least this long (a vocabulary-wide
#: output gradient's Gram); below, float64 measured no slower (``benchmarks/certified_products.py``).
SPLIT_ON_CPU_FROM = 1 << 62

#: Elements of float32 block results held at once by the split route (64 MiB).
SPLIT_BLOCK = 1 << 24

_forced: Optional[str] = None


@contextlib.contextmanager
def use_route(route: Optional[str]) -> Iterator[None]:
    """Force ``"split"`` or ``"float64"`` for every certified product formed inside (``None``: automatic)."""
    global _forced
    if route not in (None, "split", "float64"):
        raise ValueError(f"route must be 'split', 'float64' or None, not {route!r}")
    before, _forced = _forced, route
    try:
        yield
    finally:
        _forced = before


def products_route(device: torch.device, contraction: int) -> str:
    """``"split"`` or ``"float64"`` for a product of ``contraction`` terms on ``device``."""
    if _forced is not None:
        return _forced
    if torch.device(device).type != "cpu":
        return "split"
    return "split" if contraction >= SPLIT_ON_CPU_FROM else "float64"


@dataclass
class CertifiedProduct:
    """``x @ y`` per sample: ``value`` ``(B, m, q)`` float64, and ``bounds``, pairs ``(u (B, m), v (B, q))``
    with ``|value - x @ y| <= sum_r u_r v_r^T`` entry by entry (float64, rounded up)."""

    value: torch.Tensor
    bounds: Tuple[Tuple[torch.Tensor, torch.Tensor], ...]


def certified_product(x: torch.Tensor, y: torch.Tensor, route: Optional[str] = None) -> CertifiedProduct:
    """``x @ y`` for ``x`` ``(B, m, n)`` and ``y`` ``(B, n, q)`` (any float dtype), certified."""
    route = route or products_route(x.device, x.shape[-1])
    if route == "float64" or x.dtype == torch.float64 or y.dtype == torch.float64:
        return _float64_product(x, y)
    return _split_product(x, y)


def certified_gram(x: torch.Tensor, route: Optional[str] = None) -> CertifiedProduct:
    """``x x^T`` per sample for ``x`` ``(B, T, n)``."""
    return certified_product(x, x.transpose(1, 2), route)


def _norms_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Euclidean norms along ``dim`` in float64, rounded up (non-negative terms: a relative bound)."""
    norms = torch.linalg.vector_norm(t, dim=dim, dtype=torch.float64)
    return norms * (1 + gamma(t.shape[dim] + 2, torch.float64))


def _float64_product(x: torch.Tensor, y: torch.Tensor) -> CertifiedProduct:
    value = torch.bmm(x.to(torch.float64), y.to(torch.float64))
    n = x.shape[-1]
    u = _norms_up(x, 2) * gamma(n + 1, torch.float64)
    return CertifiedProduct(value, ((u, _norms_up(y, 1)),))


def high_bits(block: int, input_roundoff: float) -> int:
    """``K``, the bits of a high part: the most with ``block 2^(2K) <= 2^24`` (every partial sum of a block
    an integer float32 holds), and no more than the matmul's inputs keep (bf16 8, TF32 11 significant bits)."""
    bits = (24 - max(0, math.ceil(math.log2(block)))) // 2
    if input_roundoff:
        bits = min(bits, round(-math.log2(input_roundoff)))
    return bits


def _split(t: torch.Tensor, dim: int, bits: int):
    """``t`` (float32) scaled along ``dim`` by powers of two, ``2^(bits - e)`` with every entry below ``2^e``:
    returns ``(scaled, high, low, e)``, ``scaled == high + low`` exactly, ``high`` integers, ``|low| <= 1/2``.
    ``e`` is kept within ``[-100, 128]`` so that the scale is a normal float32 (a tiny row only gets
    fewer bits in its high part)."""
    peak = t.abs().amax(dim, keepdim=True)
    exponent = torch.frexp(peak).exponent.clamp(-100, 128)
    scaled = t * torch.ldexp(torch.ones_like(peak), bits - exponent)
    high = scaled.round()
    return scaled, high, scaled - high, exponent


def _matmul_input_roundoff() -> float:
    """The unit roundoff a float32 matmul's inputs may be rounded to: 0 at ``"highest"`` precision,
    TF32's (``"high"``, also the CUDA TF32 switch) or bf16's (``"medium"``) otherwise."""
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return 2.0 ** -8
    if precision == "high" or (torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32):
        return 2.0 ** -11
    return 0.0


def _split_product(x: torch.Tensor, y: torch.Tensor) -> CertifiedProduct:
    x, y = x.float(), y.float()
    batch, m, n = x.shape
    q = y.shape[2]
    blocks = max(1, math.ceil(n / CHUNK))
    pad = blocks * CHUNK - n
    if pad:
        x, y = torch.nn.functional.pad(x, (0, pad)), torch.nn.functional.pad(y, (0, 0, 0, pad))
    u_in = _matmul_input_roundoff()
    bits = high_bits(min(n, CHUNK), u_in)
    xs, xh, xl, ex = _split(x, 2, bits)
    ys, yh, yl, ey = _split(y, 1, bits)
    value = torch.zeros(batch, m, q, dtype=torch.float64, device=x.device)
    step = max(1, SPLIT_BLOCK // max(1, 2 * batch * m * q))
    for start in range(0, blocks, step):
        cut = slice(start * CHUNK, min(blocks, start + step) * CHUNK)

        def rows(t: torch.Tensor) -> torch.Tensor:  # (B, m, k C) -> (B, k, m, C)
            return t[:, :, cut].unflatten(2, (-1, CHUNK)).transpose(1, 2)

        def cols(t: torch.Tensor) -> torch.Tensor:  # (B, k C, q) -> (B, k, C, q)
            return t[:, cut].unflatten(1, (-1, CHUNK))

        high = torch.matmul(rows(xh), cols(yh))  # exact: integers of magnitude at most 2^24
        value += high.sum(1, dtype=torch.float64)
        del high
        mixed = torch.matmul(torch.cat([rows(xh), rows(xl)], 3), torch.cat([cols(yl), cols(ys)], 2))
        value += mixed.sum(1, dtype=torch.float64)
        del mixed
    x_scale = torch.ldexp(torch.ones_like(ex, dtype=torch.float64), ex - bits)  # (B, m, 1)
    y_scale = torch.ldexp(torch.ones_like(ey, dtype=torch.float64), ey - bits)  # (B, 1, q)
    value = value * x_scale * y_scale  # powers of two: exact
    f64 = torch.float64
    # The mixed products' float32 rounding (inputs possibly rounded too), their float64 sums over blocks and
    # with the high parts (|value| <= |x_s| |y_s| up to these errors), and the scaling's underflow: a
    # subnormal scaled entry is off by at most 2^-150.
    mixed_bound = gamma(2 * min(n, CHUNK), torch.float32) + 3 * u_in + 2 * gamma(2 * blocks + 2, f64)  # zero padding adds no rounding
    sum_bound = 2 * gamma(2, f64)
    tiny = math.sqrt(n) * 2.0 ** -150
    hx, lx, sx = (_norms_up(t, 2) for t in (xh, xl, xs))
    hy, ly, sy = (_norms_up(t, 1) for t in (yh, yl, ys))
    xs_, ys_ = x_scale.squeeze(2), y_scale.squeeze(1)
    bounds = (
        (mixed_bound * hx * xs_, ly * ys_),
        ((mixed_bound * lx + sum_bound * 1.01 * sx + tiny) * xs_, sy * ys_),
        (1.01 * sx * xs_, torch.full_like(sy, tiny) * ys_),
    )
    return CertifiedProduct(value, tuple((u * (1 + gamma(4, f64)), v) for u, v in bounds))


def _bilinear(u: torch.Tensor, matrix: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``u_i^T matrix_i v_i`` per sample (float64)."""
    return torch.bmm(torch.bmm(u.unsqueeze(1), matrix), v.unsqueeze(2)).view(-1)


def frobenius_bounds(p: CertifiedProduct, q: CertifiedProduct) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(computed, bound)`` per sample with ``|<P, Q> - computed| <= bound`` (Frobenius) for the exact
    products ``P``, ``Q`` that ``p`` and ``q`` certify: ``P = P^ - E_P`` makes
    ``<P, Q> - <P^, Q^> = -<E_P, Q^> - <P^, E_Q> + <E_P, E_Q>`` exactly, each bounded by the rank-one
    bounds; the float64 rounding of the sums is added. Float64 ``(B,)``."""
    f64 = torch.float64
    computed = torch.linalg.vecdot(p.value.flatten(1), q.value.flatten(1))
    abs_p, abs_q = p.value.abs(), q.value.abs()
    terms = p.value[0].numel()
    bound = gamma(terms + 1, f64) * torch.linalg.vecdot(abs_p.flatten(1), abs_q.flatten(1))
    for u, v in p.bounds:
        bound = bound + _bilinear(u, abs_q, v)
    for u, v in q.bounds:
        bound = bound + _bilinear(u, abs_p, v)
    for u, v in p.bounds:
        for u2, v2 in q.bounds:
            bound = bound + torch.linalg.vecdot(u, u2) * torch.linalg.vecdot(v, v2)
    return computed, bound * (1 + gamma(terms + 16, f64))


def frobenius_upper(p: CertifiedProduct, q: CertifiedProduct) -> torch.Tensor:
    """An upper bound on ``<P, Q>`` per sample (``frobenius_bounds``), never negative."""
    computed, bound = frobenius_bounds(p, q)
    return (computed + bound).clamp(min=0) * (1 + gamma(2, torch.float64))


def square_norm_upper(p: CertifiedProduct) -> torch.Tensor:
    """An upper bound on ``||P||_F^2`` per sample: ``(||P^|| + sum_r ||u_r|| ||v_r||)^2`` (``||E|| <= sum_r ||u_r v_r^T||``)."""
    f64 = torch.float64
    norm = _norms_up(p.value.flatten(1), 1)
    for u, v in p.bounds:
        norm = norm + _norms_up(u, 1) * _norms_up(v, 1)
    return norm.square() * (1 + gamma(len(p.bounds) + 4, f64))
