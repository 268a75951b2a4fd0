"""RDP of the sampled Gaussian: published values, closed forms and the series for fractional orders."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dptorch.accounting.sampled_gaussian_rdp import (
    DEFAULT_ORDERS,
    _log_a_fractional,
    _log_a_integer,
    rdp_to_epsilon,
    sampled_gaussian_rdp,
)

OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def test_published_opacus_value():
    # Opacus' RDP accountant: sigma 1.5, q 0.04, 2250 steps, delta 1e-5 -> 7.32911117143.
    rdp = 2250 * sampled_gaussian_rdp(1.5, 0.04, OPACUS_ORDERS)
    epsilon, best = rdp_to_epsilon(rdp, OPACUS_ORDERS, 1e-5)
    assert epsilon == pytest.approx(7.32911117143, rel=1e-6)
    assert OPACUS_ORDERS[best] == pytest.approx(3.9)


def test_default_grid_contains_the_dense_grid_and_large_orders():
    assert set(OPACUS_ORDERS) <= set(DEFAULT_ORDERS)
    assert max(DEFAULT_ORDERS) >= 256


def test_full_batch_is_the_gaussian_mechanism():
    orders = [1.5, 2.0, 7.3, 32.0]
    assert sampled_gaussian_rdp(2.0, 1.0, orders) == pytest.approx([a / 8 for a in orders])


@pytest.mark.parametrize("alpha", [2, 3, 5, 12])
@pytest.mark.parametrize("sigma,q", [(1.0, 0.01), (1.5, 0.04), (0.7, 0.2), (4.0, 0.5)])
def test_fractional_series_is_continuous_at_integer_orders(alpha, sigma, q):
    exact = _log_a_integer(q, sigma, alpha)
    for nearby in (alpha - 1e-7, alpha + 1e-7):
        assert _log_a_fractional(q, sigma, nearby) == pytest.approx(exact, rel=1e-5, abs=1e-12)


def test_small_q_matches_the_leading_order_expansion():
    # For small q: RDP(a) ~ a q^2 (e^(1/sigma^2) - 1) / 2.
    sigma, q = 2.0, 1e-4
    rdp = sampled_gaussian_rdp(sigma, q, [1.5, 2.5, 4.0])
    expected = [a * q**2 * math.expm1(1 / sigma**2) / 2 for a in (1.5, 2.5, 4.0)]
    assert rdp == pytest.approx(expected, rel=1e-3)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    sigma=st.floats(0.5, 20.0),
    q=st.floats(1e-4, 1.0),
)
def test_rdp_is_non_negative_finite_and_grows_with_the_order(sigma, q):
    rdp = sampled_gaussian_rdp(sigma, q, DEFAULT_ORDERS[:120])
    assert np.all(np.isfinite(rdp)) and np.all(rdp >= 0)
    assert np.all(np.diff(rdp) >= -1e-12 * np.abs(rdp[1:]))


def test_orders_must_exceed_one():
    with pytest.raises(ValueError, match="orders must all be > 1"):
        sampled_gaussian_rdp(1.0, 0.1, [1.0, 2.0])


def test_conversion_formula():
    # eps = rdp + log((a - 1) / a) - (log(delta) + log(a)) / (a - 1), at a single order.
    a, rdp, delta = 8.0, 0.5, 1e-5
    expected = rdp + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
    assert rdp_to_epsilon([rdp], [a], delta) == (pytest.approx(expected), 0)
