"""Accountant names and construction: ``create_accountant("pld")`` and friends."""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

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


def register_accountant(name: str, accountant: Type[Accountant], force: bool = False) -> None:
    """Make ``create_accountant(name)`` (and ``make_private(accountant=name)``) build ``accountant``.

    ``accountant`` is an :class:`Accountant` subclass taking no constructor argument; a name already
    taken is refused unless ``force=True`` replaces it.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an accountant's name must be a non-empty string, got {name!r}")
    if not (isinstance(accountant, type) and issubclass(accountant, Accountant)):
        raise TypeError(f"register_accountant needs a subclass of dptorch.accounting.Accountant, got {accountant!r}")
    canonical = name.strip().lower()
    if canonical in ACCOUNTANTS and not force:
        raise ValueError(f"an accountant named {canonical!r} is already registered ({ACCOUNTANTS[canonical].__name__}); "
                         "pass force=True to replace it")
    ACCOUNTANTS[canonical] = accountant


def check_accountant_name(name: object, argument: str = "accountant") -> str:
    """Return the canonical (lower-case) accountant name, or raise ValueError listing the valid ones."""
    canonical = name.strip().lower() if isinstance(name, str) else name
    if canonical not in ACCOUNTANTS:
        valid = ", ".join(repr(n) for n in ACCOUNTANTS)
        raise ValueError(f"{argument} must be one of {valid}, got {name!r}")
    return canonical  # type: ignore[return-value]


def create_accountant(name: Optional[str] = None, *, mechanism: Optional[str] = None, **options: Any) -> Accountant:
    """A new accountant by name: "pld" (default), "prv", "rdp" or "gdp" (approximation).

    ``mechanism=`` is Opacus' keyword for the name. ``options`` go to the accountant's constructor
    (e.g. ``orders`` for "rdp").
    """
    if name is not None and mechanism is not None:
        raise TypeError(f"create_accountant got the name twice ({name!r} and mechanism={mechanism!r}): pass one")
    chosen = next((given for given in (name, mechanism) if given is not None), DEFAULT_ACCOUNTANT)
    return ACCOUNTANTS[check_accountant_name(chosen)](**options)


def accountant_from_state_dict(state_dict: Dict[str, Any]) -> Accountant:
    """A new accountant of the kind that saved ``state_dict``, with its history loaded."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict made by Accountant.state_dict(), got {type(state_dict).__name__}")
    accountant = create_accountant(state_dict.get("mechanism", DEFAULT_ACCOUNTANT))
    accountant.load_state_dict(state_dict)
    return accountant
