"""Privacy accounting for DP-SGD: (epsilon, delta) of Poisson-sampled Gaussian steps.

Each accountant composes the steps of one batch :class:`Selection` (Poisson by default; truncated
Poisson with "pld", fixed-size sampling without replacement with "rdp": :mod:`dptorch.accounting.selection`).

Accountants share one interface (``step``, ``get_epsilon``, ``history``, ``state_dict``):

* :class:`PLDAccountant` ("pld", the default): privacy loss distributions (``dp_accounting``).
* :class:`PRVAccountant` ("prv"): privacy random variables with proven error bounds.
* :class:`RDPAccountant` ("rdp"): Rényi DP; a looser but classic upper bound.
* :class:`GDPAccountant` ("gdp"): central-limit approximation, not a bound; warns.

:func:`get_noise_multiplier` calibrates sigma to an (epsilon, delta) target (with a bound:
"pld", "prv" or "rdp"; the "gdp" approximation is refused there).
"""

from dptorch.accounting.base import Accountant, DeltaResolutionWarning
from dptorch.accounting.calibration import check_calibration_accountant, get_noise_multiplier, steps_for_epochs
from dptorch.accounting.curve import epsilon_curve
from dptorch.accounting.factory import (
    ACCOUNTANTS,
    DEFAULT_ACCOUNTANT,
    accountant_from_state_dict,
    check_accountant_name,
    create_accountant,
)
from dptorch.accounting.gdp import GDPAccountant, GDPApproximationWarning
from dptorch.accounting.pld import PLDAccountant
from dptorch.accounting.privacy_random_variable import EpsilonBounds
from dptorch.accounting.prv import PRVAccountant
from dptorch.accounting.rdp import RDPAccountant, RDPOrderGridWarning
from dptorch.accounting.selection import Selection

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "DEFAULT_ACCOUNTANT",
    "DeltaResolutionWarning",
    "EpsilonBounds",
    "GDPAccountant",
    "GDPApproximationWarning",
    "PLDAccountant",
    "PRVAccountant",
    "RDPAccountant",
    "RDPOrderGridWarning",
    "Selection",
    "accountant_from_state_dict",
    "check_accountant_name",
    "check_calibration_accountant",
    "create_accountant",
    "epsilon_curve",
    "get_noise_multiplier",
    "steps_for_epochs",
]
