"""Input checks shared by the accountants, the calibration and the CLI.

Every check raises ``ValueError`` with a message that names the argument, the bad value and
the valid range, so callers (the CLI in particular) can show it as is.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Optional


def is_number(value: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def check_noise_multiplier(value: object, name: str = "noise_multiplier") -> float:
    """Return ``value`` as a float; it must be finite and > 0."""
    sigma = _as_float(name, value)
    if not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return sigma


def check_sample_rate(value: object, name: str = "sample_rate") -> float:
    """Return ``value`` as a float; it must lie in (0, 1]."""
    q = _as_float(name, value)
    if not 0 < q <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return q


def check_delta(value: object, name: str = "delta") -> float:
    """Return ``value`` as a float; it must lie in (0, 1)."""
    delta = _as_float(name, value)
    if not 0 < delta < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return delta


#: Opacus' tutorials set ``DELTA = 1 / len(train_dataloader)``: one over the number of batches.
_OPACUS_DELTA_IDIOM = (
    ". (Opacus' tutorials set DELTA = 1 / len(train_dataloader), one over the number of batches, which is far "
    "above 1/N; with dptorch use e.g. DELTA = 1 / (10 * len(train_dataloader.dataset)) or 1e-5.)"
)


def check_delta_for_units(
    delta: object, num_units: Optional[int], name: str = "delta", sample_rate: Optional[float] = None
) -> float:
    """A delta in (0, 1) and, when the number of privacy units N is known, below 1/N.

    An (epsilon, delta) guarantee with delta >= 1/N says nothing: the mechanism that publishes one
    unit chosen at random meets it. The engine, the private Trainer and the command line refuse such
    a delta for calibration and for reporting alike. Without N but with the sample rate q, N is at
    least 1/q (an expected batch of one unit or more), so a delta >= q is refused the same way.
    """
    if not is_number(delta) or not 0 < delta < 1:  # type: ignore[operator]
        raise ValueError(f"{name} must be a number in (0, 1), got {delta!r}")
    value = float(delta)  # type: ignore[arg-type]
    if num_units is not None and num_units > 0 and value >= 1 / num_units:
        raise ValueError(
            f"{name}={value:g} is not below 1/N for N={num_units} privacy units: such a delta allows releasing a "
            f"unit outright, so no epsilon at it means anything. Choose {name} < 1/N = {1 / num_units:.3g}"
            + (" (1e-5 or smaller is usual)" if num_units <= 10**5 else "") + _OPACUS_DELTA_IDIOM
        )
    if num_units is None and sample_rate is not None and value >= sample_rate:
        raise ValueError(
            f"{name}={value:g} is not below the sample rate {sample_rate:g}: a data set sampled at that rate with an "
            f"expected batch of one unit or more holds N >= 1/q = {1 / sample_rate:.3g} units, and a delta >= 1/N "
            f"allows releasing a unit outright, so no epsilon at it means anything. Choose {name} < 1/N "
            "(1e-5 or smaller is usual)" + _OPACUS_DELTA_IDIOM
        )
    return value


def check_epsilon(value: object, name: str = "target_epsilon") -> float:
    """Return ``value`` as a float; it must be finite and > 0."""
    epsilon = _as_float(name, value)
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return epsilon


def check_steps(value: object, name: str = "steps") -> int:
    """Return ``value`` as an int; it must be a whole number >= 0."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    if isinstance(value, Integral):
        steps = int(value)
    else:
        number = _as_float(name, value)
        if not (math.isfinite(number) and number == int(number)):
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        steps = int(number)
    if steps < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return steps


def check_positive(value: object, name: str) -> float:
    """Return ``value`` as a float; it must be finite and > 0 (tolerances, epochs)."""
    number = _as_float(name, value)
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def check_non_negative(value: object, name: str) -> float:
    """Return ``value`` as a float; it must be finite and >= 0."""
    number = _as_float(name, value)
    if not (number >= 0 and math.isfinite(number)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number
