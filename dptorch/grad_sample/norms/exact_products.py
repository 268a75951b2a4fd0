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
float64 matrix product runs at 1/15 to 1/64 of float32's rate there, and MPS has none), ``"float64"`` on
CPU, where it measured 2-3.8x faster than the split route (``benchmarks/certified_products.py``: a
float64 product costs 3-5x a float32 one there, the split route three float32 products plus its
elementwise passes); ``use_route`` (or ``DPTORCH_CERTIFIED_PRODUCTS``) forces one.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from dptorch.grad_sample.norms.certified import gamma, unit_roundoff

#: Contraction terms of one exact block: ``high_bits`` keeps ``CHUNK * 2^(2 K) <= 2^24`` (``K = 8`` here,
#: more for shorter products).
CHUNK = 256

#: Elements of float32 block results held at once by the split route (64 MiB).
SPLIT_BLOCK = 1 << 24

#: ``DPTORCH_CERTIFIED_PRODUCTS=split`` (or ``float64``) forces a route for the whole process (running a
#: test suite on the accelerators' route on CPU); unset, the route is automatic.
_forced: Optional[str] = os.environ.get("DPTORCH_CERTIFIED_PRODUCTS") or None
if _forced not in (None, "split", "float64"):
    raise ValueError(f"DPTORCH_CERTIFIED_PRODUCTS must be 'split' or 'float64', not {_forced!r}")


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


def products_route(device: torch.device) -> str:
    """``"split"`` or ``"float64"``: the route of certified products on ``device``."""
    if _forced is not None:
        return _forced
    return "float64" if torch.device(device).type == "cpu" else "split"


@dataclass
class CertifiedProduct:
    """``x @ y`` per sample: ``value`` ``(B, m, q)`` float64, and ``bounds``, pairs ``(u (B, m), v (B, q))``
    with ``|value - x @ y| <= sum_r u_r v_r^T`` entry by entry (float64, rounded up); ``rows`` and ``cols``
    bound the norms of ``x``'s rows and ``y``'s columns (``(B, m)``, ``(B, q)``), so ``|x @ y| <= rows cols^T``."""

    value: torch.Tensor
    bounds: Tuple[Tuple[torch.Tensor, torch.Tensor], ...]
    rows: torch.Tensor
    cols: torch.Tensor


class ProductSum:
    """The certified sum of the products of a factor cut along its contraction (``x = [x_1 ... x_k]``,
    ``y`` likewise: ``x @ y = sum_k x_k @ y_k``), one block at a time. The blocks' bounds are merged pair by
    pair with Cauchy-Schwarz (``sum_k u_k v_k^T <= sqrt(sum_k u_k^2) sqrt(sum_k v_k^2)^T``), the row and
    column norms likewise, and the float64 sum of the values adds ``gamma_k rows cols^T``."""

    def __init__(self) -> None:
        self.total: Optional[CertifiedProduct] = None
        self.count = 0

    def add(self, p: CertifiedProduct) -> None:
        self.count += 1
        t = self.total
        if t is None:
            self.total = p
            return
        grow = 1 + gamma(4, torch.float64)  # the hypotenuses' own rounding
        bounds = tuple((torch.hypot(u, u2) * grow, torch.hypot(v, v2)) for (u, v), (u2, v2) in zip(t.bounds, p.bounds))
        self.total = CertifiedProduct(t.value + p.value, bounds, torch.hypot(t.rows, p.rows) * grow,
                                      torch.hypot(t.cols, p.cols) * grow)

    def result(self) -> CertifiedProduct:
        t = self.total
        if self.count <= 1:
            return t
        rounding = (gamma(self.count + 1, torch.float64) * t.rows, t.cols)
        return CertifiedProduct(t.value, t.bounds + (rounding,), t.rows, t.cols)


def certified_product(x: torch.Tensor, y: torch.Tensor, route: Optional[str] = None) -> CertifiedProduct:
    """``x @ y`` for ``x`` ``(B, m, n)`` and ``y`` ``(B, n, q)`` (any float dtype), certified. Float64
    operands (``operands``) take the float64 route without a copy."""
    route = route or products_route(x.device)
    if route == "float64" or x.dtype == torch.float64 or y.dtype == torch.float64:
        x, y = x.to(torch.float64), y.to(torch.float64)
        rows, cols = _norms_up(x, 2), _norms_up(y, 1)
        return CertifiedProduct(torch.bmm(x, y), ((rows * gamma(x.shape[-1] + 1, torch.float64), cols),), rows, cols)
    return _split_product_nt(x, y.transpose(1, 2))


def certified_gram(x: torch.Tensor, route: Optional[str] = None) -> CertifiedProduct:
    """``x x^T`` per sample for ``x`` ``(B, T, n)`` (one cast and one set of row norms on the float64 route)."""
    route = route or products_route(x.device)
    if route == "float64" or x.dtype == torch.float64:
        x = x.to(torch.float64)
        norms = _norms_up(x, 2)
        value = torch.bmm(x, x.transpose(1, 2))
        return CertifiedProduct(value, ((norms * gamma(x.shape[-1] + 1, torch.float64), norms),), norms, norms)
    return _split_product_nt(x, None)


def operands(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The factors as the products will read them: float64 copies on the float64 route (made once here, for
    every product and magnitude that reads them), float32 (or as they are, if wider) on the split route."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        wide = products_route(t.device) == "float64"
        return t.to(torch.float64) if wide else t.to(torch.promote_types(t.dtype, torch.float32))
    return tuple(cast(t) for t in tensors)


def _norms_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Euclidean norms along ``dim`` in float64, rounded up (non-negative terms: a relative bound)."""
    norms = torch.linalg.vector_norm(t, dim=dim, dtype=torch.float64)
    return norms * (1 + gamma(t.shape[dim] + 2, torch.float64))


def high_bits(block: int, input_roundoff: float) -> int:
    """``K``, the bits of a high part: the most with ``block 2^(2K) <= 2^24`` (every partial sum of a block
    an integer float32 holds), and no more than the matmul's inputs keep (bf16 8, TF32 11 significant bits)."""
    bits = (24 - max(0, math.ceil(math.log2(block)))) // 2
    if input_roundoff:
        bits = min(bits, round(-math.log2(input_roundoff)))
    return bits


@dataclass
class _Split:
    """A factor ``(B, m, n)`` cut into blocks of ``CHUNK`` along ``n`` and split row by row: ``scaled``
    (``(B, blocks, m, CHUNK)``, each row times ``2^(bits - e)`` with every entry below ``2^e``), ``high``
    (integers, ``|high| <= 2^bits``) and ``low`` (``|low| <= 1/2``), ``scaled == high + low`` exactly; ``scale``
    ``2^(e - bits)`` per row (float64, ``(B, m)``); the rows' norms of the three parts (float64, rounded up)."""

    scaled: torch.Tensor
    high: torch.Tensor
    low: torch.Tensor
    scale: torch.Tensor
    norms: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _split_rows(t: torch.Tensor, bits: int) -> _Split:
    """Split the rows of ``t`` (``e`` kept within ``[-100, 128]`` so that the scale is a normal float32:
    a tiny row only gets fewer bits in its high part)."""
    batch, m, n = t.shape
    blocks = max(1, math.ceil(n / CHUNK))
    laid = t.new_zeros(batch, blocks, m, CHUNK, dtype=torch.float32)  # block-major: each block's rows contiguous
    rows = laid.permute(0, 2, 1, 3)  # (B, m, blocks, CHUNK): a view of the same memory
    full, rest = divmod(n, CHUNK)
    if full:
        rows[:, :, :full].copy_(t[:, :, :full * CHUNK].unflatten(2, (full, CHUNK)))
    if rest:
        rows[:, :, full, :rest].copy_(t[:, :, full * CHUNK:])
    peak = laid.abs().amax(dim=(1, 3), keepdim=True)  # (B, 1, m, 1)
    exponent = torch.frexp(peak).exponent.clamp(-100, 128)
    scaled = laid.mul_(torch.ldexp(torch.ones_like(peak), bits - exponent))  # powers of two: exact (but underflow)
    high = scaled.round()
    low = scaled - high
    f32 = torch.float32
    up = 1 + gamma(blocks * CHUNK + 2, f32)  # float32 sums of squares (no overflow: entries below 2^bits)
    norms = tuple(torch.linalg.vector_norm(part, dim=(1, 3)).double() * up for part in (high, low, scaled))
    scale = torch.ldexp(torch.ones_like(peak, dtype=torch.float64), exponent - bits).view(batch, m)
    return _Split(scaled, high, low, scale, norms)


def _matmul_input_roundoff() -> float:
    """The unit roundoff a float32 matmul's inputs may be rounded to: 0 at ``"highest"`` precision,
    TF32's (``"high"``, also the CUDA TF32 switch) or bf16's (``"medium"``) otherwise."""
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return 2.0 ** -8
    if precision == "high" or (torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32):
        return 2.0 ** -11
    return 0.0


def _split_product_nt(x: torch.Tensor, z: Optional[torch.Tensor]) -> CertifiedProduct:
    """``x @ z^T`` (``z=None``: ``x @ x^T``, one split) for ``x`` ``(B, m, n)``, ``z`` ``(B, q, n)``."""
    batch, m, n = x.shape
    u_in = _matmul_input_roundoff()
    bits = high_bits(min(n, CHUNK), u_in)
    sx = _split_rows(x, bits)
    sz = sx if z is None else _split_rows(z, bits)
    q = sz.high.shape[2]
    blocks = sx.high.shape[1]
    value = torch.zeros(batch, m, q, dtype=torch.float64, device=x.device)
    step = max(1, SPLIT_BLOCK // max(1, batch * m * q))
    for start in range(0, blocks, step):
        part = slice(start, min(blocks, start + step))

        def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # (B, k, m, C) x (B, k, q, C) -> (B, k, m, q)
            return torch.matmul(a[:, part], b[:, part].transpose(2, 3))

        value += pair(sx.high, sz.high).sum(1, dtype=torch.float64)  # exact: integers of magnitude <= 2^24
        mixed = pair(sx.high, sz.low)
        mixed += pair(sx.low, sz.scaled)
        value += mixed.sum(1, dtype=torch.float64)
        del mixed
    value = value * sx.scale.unsqueeze(2) * sz.scale.unsqueeze(1)  # powers of two: exact
    f64 = torch.float64
    # The mixed products' float32 rounding (each of length min(n, CHUNK): zero padding adds none; inputs
    # possibly rounded too; one more rounding for their sum), their float64 sums over blocks and with the
    # high parts (|value| <= |x_s| |z_s| up to these errors), and the scaling's underflow (a subnormal
    # scaled entry is off by at most 2^-150).
    mixed_bound = gamma(min(n, CHUNK) + 2, torch.float32) + 3 * u_in + 2 * gamma(2 * blocks + 2, f64)
    sum_bound = 2 * gamma(2, f64)
    tiny = math.sqrt(n) * 2.0 ** -150
    hx, lx, sx_ = sx.norms
    hz, lz, sz_ = sz.norms
    bounds = (
        (mixed_bound * hx * sx.scale, lz * sz.scale),
        ((mixed_bound * lx + sum_bound * 1.01 * sx_ + tiny) * sx.scale, sz_ * sz.scale),
        (1.01 * sx_ * sx.scale, torch.full_like(sz_, tiny) * sz.scale),
    )
    grow = 1 + gamma(4, f64)
    return CertifiedProduct(value, tuple((u * grow, v) for u, v in bounds), sx_ * sx.scale * grow, sz_ * sz.scale * grow)


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
    terms = p.value.shape[1] * p.value.shape[2]
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
