"""create_accountant and friends."""

import pytest

from dptorch.accounting import (
    DEFAULT_ACCOUNTANT,
    GDPAccountant,
    GDPApproximationWarning,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    create_accountant,
)


def test_pld_is_the_default():
    assert DEFAULT_ACCOUNTANT == "pld"
    assert isinstance(create_accountant(), PLDAccountant)


@pytest.mark.parametrize("name,cls", [("pld", PLDAccountant), ("prv", PRVAccountant), ("rdp", RDPAccountant), ("RDP ", RDPAccountant)])
def test_names(name, cls):
    assert type(create_accountant(name)) is cls


def test_gdp_by_name_warns():
    with pytest.warns(GDPApproximationWarning):
        assert isinstance(create_accountant("gdp"), GDPAccountant)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="accountant must be one of 'pld', 'prv', 'rdp', 'gdp', got 'moments'"):
        create_accountant("moments")


def test_options_reach_the_constructor():
    assert create_accountant("rdp", orders=[2, 3]).orders == (2.0, 3.0)
    assert create_accountant("pld", value_discretization_interval=1e-3).value_discretization_interval == 1e-3
