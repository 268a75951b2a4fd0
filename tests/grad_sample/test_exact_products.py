"""Certified products hold their bound against exact rational arithmetic, on both routes.

``certified_product(x, y)`` returns ``x @ y`` in float64 with rank-one bounds ``|error| <= sum_r u_r v_r^T``;
``frobenius_bounds`` and ``square_norm_upper`` build the norms of clip factors on them. Each check here
compares against the exact value (Python fractions of the float inputs), on crafted worst cases: products
that cancel to (almost) nothing, entries spanning 2^-140 to 2^60, subnormal and zero rows, lengths across
the split route's block size, bf16 inputs.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from dptorch.grad_sample.norms.certified import gamma
from dptorch.grad_sample.norms.exact_products import (
    CHUNK,
    ProductSum,
    certified_gram,
    certified_product,
    frobenius_bounds,
    high_bits,
    products_route,
    square_norm_upper,
    use_route,
)

ROUTES = ("split", "float64")


def exact_matmul(x: torch.Tensor, y: torch.Tensor):
    """``x @ y`` per sample in fractions (exact)."""
    xf = [[[Fraction(float(v)) for v in row] for row in sample] for sample in x.double().tolist()]
    yf = [[[Fraction(float(v)) for v in row] for row in sample] for sample in y.double().tolist()]
    return [[[sum((a * b for a, b in zip(row, col)), Fraction(0)) for col in zip(*ys)] for row in xs] for xs, ys in zip(xf, yf)]


def bound_matrix(product) -> torch.Tensor:
    return sum(u.unsqueeze(2) * v.unsqueeze(1) for u, v in product.bounds)


def assert_certified(product, exact) -> None:
    bound = bound_matrix(product).tolist()
    value = product.value.tolist()
    for b, sample in enumerate(exact):
        for i, row in enumerate(sample):
            for j, want in enumerate(row):
                assert abs(Fraction(value[b][i][j]) - want) <= Fraction(bound[b][i][j]), (b, i, j)


def cancelling(generator, m: int, n: int, q: int, dtype) -> tuple:
    """Rows of ``x`` that are nearly orthogonal to columns of ``y`` by construction (large terms that cancel),
    plus one entry far above and one far below the rest."""
    x = torch.randn(1, m, n, generator=generator, dtype=torch.float64)
    y = torch.randn(1, n, q, generator=generator, dtype=torch.float64)
    x[0, 0] = 2.0**20 * y[0, :, 0] + 2.0**-10 * torch.randn(n, generator=generator, dtype=torch.float64)
    x[0, 1, n // 2:] = -x[0, 1, : n - n // 2].flip(0)[: n - n // 2] if n > 1 else x[0, 1, :]
    x[0, -1, 0] = 2.0**60
    x[0, -1, -1] = 2.0**-140
    return x.to(dtype), y.to(dtype)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 3, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_the_product_is_within_its_bound(route, dtype, n):
    g = torch.Generator().manual_seed(n)
    x, y = cancelling(g, 3, n, 2, dtype)
    product = certified_product(x, y, route)
    assert product.value.dtype == torch.float64
    assert_certified(product, exact_matmul(x, y))


@pytest.mark.parametrize("route", ROUTES)
def test_zero_subnormal_and_huge_rows(route):
    x = torch.zeros(1, 4, 300)
    x[0, 1] = torch.full((300,), 1e-44)  # subnormal float32
    x[0, 2, :150] = 3e38
    x[0, 2, 150:] = -3e38 * 2.0**-130
    x[0, 3] = torch.linspace(-1, 1, 300) * 2.0**-120
    y = torch.randn(1, 300, 3, generator=torch.Generator().manual_seed(1)) * 1e-30
    product = certified_product(x, y, route)
    assert torch.isfinite(product.value).all()
    assert_certified(product, exact_matmul(x, y))


@pytest.mark.parametrize("route", ROUTES)
def test_a_gram_sum_that_cancels_is_bounded(route):
    """The crafted record of ``test_certified_norms``: two identical tokens with output gradients ``K u`` and
    ``-K u + delta``; ``<a a^T, b b^T>`` is ``||delta||^2 ||a||^2`` exactly, far below its terms."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(1, 1, 40, generator=g).repeat(1, 2, 1)
    u = torch.randn(24, generator=g)
    b = torch.stack([2.0**24 * u, -(2.0**24) * u + torch.randn(24, generator=g)]).unsqueeze(0)
    computed, bound = frobenius_bounds(certified_gram(a, route), certified_gram(b, route))
    ga, gb = exact_matmul(a, a.transpose(1, 2))[0], exact_matmul(b, b.transpose(1, 2))[0]
    exact = sum(ga[t][s] * gb[t][s] for t in range(2) for s in range(2))
    assert abs(Fraction(float(computed)) - exact) <= Fraction(float(bound))
    assert exact >= 0 and float(exact) < 1e-6 * float(gb[0][0] * ga[0][0])  # it does cancel


@pytest.mark.parametrize("route", ROUTES)
def test_an_instantiated_norm_is_bounded_above(route):
    g = torch.Generator().manual_seed(4)
    x, y = cancelling(g, 3, 2 * CHUNK + 7, 4, torch.float32)
    exact = exact_matmul(x, y)
    exact_sq = sum(v * v for row in exact[0] for v in row)
    assert Fraction(float(square_norm_upper(certified_product(x, y, route)))) >= exact_sq


@pytest.mark.parametrize("n", [16, CHUNK, 5000])
def test_the_split_route_is_tight_on_ordinary_data(n):
    """On random data the split route's bound is below 1e-6 of ``||x_i|| ||y_j||`` and at least 30x below
    float32's own (``gamma_n``): the norms built on it stay within 1e-5 of exact (``test_certified_norms``)."""
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(2, 8, n, generator=g), torch.randn(2, n, 8, generator=g)
    product = certified_product(x, y, "split")
    scale = x.double().norm(dim=2).unsqueeze(2) * y.double().norm(dim=1).unsqueeze(1)
    relative = (bound_matrix(product) / scale).max()
    assert relative < 1e-6 and relative < gamma(n, torch.float32) / 30
    reference = torch.bmm(x.double(), y.double())  # its own error is below 1e-13 of scale
    assert ((product.value - reference).abs() <= bound_matrix(product) + 1e-13 * scale).all()


def test_high_parts_fit_a_float32_sum_and_the_matmul_inputs():
    for block in (1, 2, 16, 64, 255, 256):
        bits = high_bits(block, 0.0)
        assert block * 2 ** (2 * bits) <= 2**24 and block * 2 ** (2 * bits + 2) > 2**24
    assert high_bits(16, 2.0**-8) == 8 and high_bits(16, 2.0**-11) == 10 and high_bits(2, 2.0**-11) == 11


@use_route(None)  # automatic, whatever DPTORCH_CERTIFIED_PRODUCTS says
def test_the_route_follows_the_device_unless_forced():
    assert products_route(torch.device("cuda")) == "split"
    assert products_route(torch.device("mps")) == "split"
    assert products_route(torch.device("cpu")) == "float64"
    with use_route("split"):
        assert products_route(torch.device("cpu")) == "split"
        with use_route("float64"):
            assert products_route(torch.device("cuda")) == "float64"
        assert products_route(torch.device("cpu")) == "split"
    with pytest.raises(ValueError, match="route must be"):
        with use_route("float32"):
            pass


def test_the_frobenius_bound_covers_products_off_by_their_whole_bound():
    """Products whose values are off by exactly their stated bounds, signed so that the three error terms
    of ``<P, Q>`` add up: the bound is met with equality, and dropping any term fails here."""
    from dptorch.grad_sample.norms.exact_products import CertifiedProduct

    g = torch.Generator().manual_seed(5)
    p_value = torch.rand(1, 3, 3, generator=g, dtype=torch.float64) + 0.5  # P^ > 0
    q_value = -torch.rand(1, 3, 3, generator=g, dtype=torch.float64) - 0.5  # Q^ < 0
    u, v, u2, v2 = (torch.rand(1, 3, generator=g, dtype=torch.float64) + 0.5 for _ in range(4))
    e_p = u.unsqueeze(2) * v.unsqueeze(1)
    e_q = u2.unsqueeze(2) * v2.unsqueeze(1)
    p_exact, q_exact = p_value + e_p, q_value - e_q  # E_P = -e_p, E_Q = e_q: every error term adds
    big = torch.full((1, 3), 10.0, dtype=torch.float64)  # row and column norms: not read by the Frobenius bound
    computed, bound = frobenius_bounds(CertifiedProduct(p_value, ((u, v),), big, big),
                                       CertifiedProduct(q_value, ((u2, v2),), big, big))
    exact = sum(Fraction(a) * Fraction(b) for a, b in zip(p_exact.flatten().tolist(), q_exact.flatten().tolist()))
    assert abs(Fraction(float(computed)) - exact) <= Fraction(float(bound))
    assert float(abs(Fraction(float(computed)) - exact)) > 0.999 * float(bound)  # tight: no term to spare


@pytest.mark.parametrize("route", ROUTES)
def test_a_product_summed_block_by_block_is_within_its_bound(route):
    """``ProductSum``: a Gram formed a block of the contraction at a time (the chunked LM head's vocabulary
    blocks) keeps a bound that holds for the whole, and its row norms bound the whole rows."""
    g = torch.Generator().manual_seed(6)
    x, _ = cancelling(g, 4, 3 * CHUNK + 40, 1, torch.float32)
    total = ProductSum()
    for start in range(0, x.shape[2], 300):
        total.add(certified_gram(x[:, :, start:start + 300], route))
    whole = total.result()
    assert_certified(whole, exact_matmul(x, x.transpose(1, 2)))
    assert (whole.rows >= x.double().norm(dim=2)).all() and (whole.cols >= x.double().norm(dim=2)).all()
