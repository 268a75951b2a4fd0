"""RDPAccountant: published value, custom orders and the grid-edge warning."""

import warnings

import pytest

from dptorch.accounting import RDPAccountant, RDPOrderGridWarning

OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def _accountant(sigma=1.5, q=0.04, steps=2250, **options):
    accountant = RDPAccountant(**options)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant


def test_published_value_with_the_default_grid():
    assert _accountant().get_epsilon(1e-5) == pytest.approx(7.32911117143, rel=2e-3)


def test_published_value_with_opacus_orders():
    epsilon, alpha = _accountant().get_epsilon_and_best_alpha(1e-5, alphas=OPACUS_ORDERS)
    assert epsilon == pytest.approx(7.32911117143, rel=1e-6)
    assert alpha == pytest.approx(3.9)


def test_steps_one_by_one_equal_one_run():
    one_by_one = RDPAccountant()
    for _ in range(50):
        one_by_one.step(noise_multiplier=1.1, sample_rate=0.02)
    assert one_by_one.history == [[1.1, 0.02, 50]]
    assert one_by_one.get_epsilon(1e-6) == pytest.approx(_accountant(1.1, 0.02, 50).get_epsilon(1e-6))


def test_more_orders_never_hurt():
    accountant = _accountant()
    coarse = accountant.get_epsilon(1e-5, alphas=[2, 4, 8, 16])
    assert accountant.get_epsilon(1e-5) <= coarse


def test_constructor_orders_replace_the_default():
    assert _accountant(orders=OPACUS_ORDERS).get_epsilon(1e-5) == pytest.approx(7.32911117143, rel=1e-6)


def test_best_order_on_the_edge_warns():
    accountant = _accountant()
    with pytest.warns(RDPOrderGridWarning, match="larger orders"):
        accountant.get_epsilon(1e-5, alphas=[1.5, 2.0, 2.5])
    with pytest.warns(RDPOrderGridWarning, match="smaller orders"):
        accountant.get_epsilon(1e-5, alphas=[20, 30, 40])


def test_interior_best_order_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _accountant().get_epsilon(1e-5)


def test_bad_orders_are_rejected():
    with pytest.raises(ValueError, match="alphas"):
        _accountant().get_epsilon(1e-5, alphas=[0.5, 2])


def test_get_rdp_adds_up_runs():
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=3)
    accountant.step(noise_multiplier=2.0, sample_rate=0.1, num_steps=5)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=2)
    first, second = RDPAccountant(), RDPAccountant()
    first.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=5)
    second.step(noise_multiplier=2.0, sample_rate=0.1, num_steps=5)
    assert accountant.get_rdp([2, 4]) == pytest.approx(first.get_rdp([2, 4]) + second.get_rdp([2, 4]))
