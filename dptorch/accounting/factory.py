"""Accountant names and construction: ``create_accountant("pld")`` and friends."""

from __future__ import annotations

from typing import Any, Dict, Type

from dptorch.accounting.base import Accountant
from dptorch.accounting.gdp import GDPAccountant
from dptorch.accounting.pld import PLDAccountant
from dptorch.accounting.prv import PRVAccountant
from dptorch.accounting.rdp import RDPAccountant

DEFAULT_ACCOUNTANT = "pld"

#: Every accountant by name; the default comes first.
ACCOUNTANTS: Dict[str, Type[Accountant]] = {
    "pld": PLDAccountant,
    "prv": PRVAccountant,
    "rdp": RDPAccountant,
    "gdp": GDPAccountant,
}


def check_accountant_name(name: object, argument: str = "accountant") -> str:
    """Return the canonical (lower-case) accountant name, or raise ValueError listing the valid ones."""
    canonical = name.strip().lower() if isinstance(name, str) else name
    if canonical not in ACCOUNTANTS:
        valid = ", ".join(repr(n) for n in ACCOUNTANTS)
        raise ValueError(f"{argument} must be one of {valid}, got {name!r}")
    return canonical  # type: ignore[return-value]


def create_accountant(name: str = DEFAULT_ACCOUNTANT, **options: Any) -> Accountant:
    """A new accountant by name: "pld" (default), "prv", "rdp" or "gdp" (approximation).

    ``options`` go to the accountant's constructor (e.g. ``orders`` for "rdp").
    """
    return ACCOUNTANTS[check_accountant_name(name)](**options)


def accountant_from_state_dict(state_dict: Dict[str, Any]) -> Accountant:
    """A new accountant of the kind that saved ``state_dict``, with its history loaded."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict made by Accountant.state_dict(), got {type(state_dict).__name__}")
    accountant = create_accountant(state_dict.get("mechanism", DEFAULT_ACCOUNTANT))
    accountant.load_state_dict(state_dict)
    return accountant
