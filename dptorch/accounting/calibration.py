"""Noise calibration: the smallest noise multiplier that meets an (epsilon, delta) target."""

from __future__ import annotations

import math
import warnings
from functools import lru_cache
from typing import Callable, Optional

from scipy.optimize import brentq

from dptorch.accounting.base import DeltaResolutionWarning
from dptorch.accounting.factory import DEFAULT_ACCOUNTANT, check_accountant_name, create_accountant
from dptorch.accounting.gdp import clt_mu, gdp_epsilon
from dptorch.accounting.pld_limits import PLDGridWarning
from dptorch.accounting.rdp import RDPOrderGridWarning
from dptorch.accounting.selection import POISSON, Selection
from dptorch.accounting.validation import (
    check_delta,
    check_epsilon,
    check_positive,
    check_sample_rate,
    check_steps,
)

#: The search range of the noise multiplier.
MIN_NOISE_MULTIPLIER = 0.05
MAX_NOISE_MULTIPLIER = 1e4


def steps_for_epochs(epochs: float, sample_rate: float) -> int:
    """Number of steps in ``epochs`` passes at Poisson rate q: ceil(epochs / q)."""
    exact = epochs / sample_rate
    nearest = round(exact)
    # 3 / 0.03 is 100.00000000000001 in floating point: that is 100 steps, not 101.
    return int(nearest) if abs(exact - nearest) <= 1e-9 * max(1.0, exact) else math.ceil(exact)


def _resolve_steps(epochs: Optional[float], steps: Optional[int], sample_rate: float) -> int:
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs and steps")
    if steps is not None:
        count = check_steps(steps)
    else:
        count = steps_for_epochs(check_positive(epochs, "epochs"), sample_rate)
    if count == 0:
        raise ValueError("steps must be >= 1 to calibrate noise, got 0")
    return count


def _gdp_seed(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Noise multiplier that the (cheap) central-limit approximation calls exact; a starting point."""

    def gap(log_sigma: float) -> float:
        mu = clt_mu(((math.exp(log_sigma), sample_rate, steps),))
        return gdp_epsilon(mu, delta) - target_epsilon

    lo, hi = math.log(MIN_NOISE_MULTIPLIER), math.log(MAX_NOISE_MULTIPLIER)
    if gap(lo) <= 0 or gap(hi) >= 0:
        return 1.0
    return math.exp(brentq(gap, lo, hi, xtol=1e-3))


class _Unreachable(Exception):
    """Even the largest noise multiplier searched exceeds the target; ``epsilon`` is what it gives."""

    def __init__(self, epsilon: float) -> None:
        super().__init__(epsilon)
        self.epsilon = epsilon


def _smallest_sigma(
    epsilon_of: Callable[[float], float], target: float, tolerance: float, start: float
) -> float:
    """Smallest sigma (up to ``tolerance`` on epsilon) with epsilon_of(sigma) <= target.

    Brackets by growing or shrinking sigma by 25% from ``start``, then narrows the bracket by
    interpolating log(eps) linearly in log(sigma), kept away from the bracket ends.
    """
    factor = 1.25
    sigma = min(max(start, MIN_NOISE_MULTIPLIER), MAX_NOISE_MULTIPLIER)
    eps = epsilon_of(sigma)
    if eps <= target:
        hi, eps_hi = sigma, eps
        while True:
            if hi <= MIN_NOISE_MULTIPLIER:
                warnings.warn(
                    f"the target is met even at noise_multiplier={MIN_NOISE_MULTIPLIER}, the smallest "
                    f"value searched (epsilon {eps_hi:.4g}); smaller values may meet it too",
                    stacklevel=3,
                )
                return hi
            lo = max(hi / factor, MIN_NOISE_MULTIPLIER)
            eps_lo = epsilon_of(lo)
            if eps_lo > target:
                break
            hi, eps_hi = lo, eps_lo
    else:
        lo, eps_lo = sigma, eps
        while True:
            if lo >= MAX_NOISE_MULTIPLIER:
                raise _Unreachable(eps_lo)
            hi = min(lo * factor, MAX_NOISE_MULTIPLIER)
            eps_hi = epsilon_of(hi)
            if eps_hi <= target:
                break
            lo, eps_lo = hi, eps_hi

    aim = target * (1 - tolerance / 2)
    while eps_hi < target * (1 - tolerance) and hi / lo - 1 > 1e-9:
        if eps_hi > 0 and math.isfinite(eps_lo):
            fraction = math.log(eps_lo / aim) / math.log(eps_lo / eps_hi)
            fraction = min(max(fraction, 0.1), 0.9)
        else:
            fraction = 0.5
        mid = lo * (hi / lo) ** fraction
        eps_mid = epsilon_of(mid)
        if eps_mid <= target:
            hi, eps_hi = mid, eps_mid
        else:
            lo, eps_lo = mid, eps_mid
    return hi


#: Accountant calls each figure of the unreachable-target message may take (bisection steps).
ADVICE_CALLS = 10


def _largest_meeting(meets: Callable[[float], bool], lo: float, hi: float) -> float:
    """The largest x found in [lo, hi] with ``meets(x)`` (given ``meets(lo)``, not ``meets(hi)``), by
    :data:`ADVICE_CALLS` geometric bisection steps; the answer always meets."""
    for _ in range(ADVICE_CALLS):
        mid = math.sqrt(lo * hi)
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _round_down(value: float, digits: int = 3) -> float:
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return math.floor(value * scale) / scale


def _unreachable_message(epsilon_at: Callable[[float, float, int], float], reached: float, target: float,
                         delta: float, sample_rate: float, steps: int, accountant: str, vary_rate: bool = True) -> str:
    """Why the target is refused, and what reaches it at the largest noise multiplier searched: fewer
    steps (epochs), or (``vary_rate``) a smaller sample rate (more data at the same batch), each with its figure."""
    sigma = MAX_NOISE_MULTIPLIER
    head = (f"target_epsilon={target:g} is unreachable: even noise_multiplier={sigma:g} gives epsilon "
            f"{reached:.4g} ({accountant}, sample rate {sample_rate:g}, {steps} steps, delta {delta:g})")
    if not math.isfinite(reached):
        return head + "; delta is below what this accountant resolves: try accountant='rdp'"
    ways = []
    if epsilon_at(sigma, sample_rate, 1) <= target:
        most = int(_largest_meeting(lambda t: epsilon_at(sigma, sample_rate, int(t)) <= target, 1, steps))
        ways.append(f"at most {most:,} steps at this sample rate (fewer epochs: {most / steps:.3g} of the planned run)")
    floor = sample_rate * 1e-6
    if vary_rate and epsilon_at(sigma, floor, steps) <= target:
        rate = _largest_meeting(lambda r: epsilon_at(sigma, r, steps) <= target, floor, sample_rate)
        rate = _round_down(rate)
        ways.append(f"a sample rate of at most {rate:.3g} at these steps (the same batch from a data set "
                    f"{sample_rate / rate:.3g}x larger, or a batch {sample_rate / rate:.3g}x smaller)")
    if not ways:
        other = "" if accountant == DEFAULT_ACCOUNTANT else f" (the '{DEFAULT_ACCOUNTANT}' accountant may: its epsilon is tighter)"
        return head + f"; no fewer steps or smaller sample rate reaches it{other}: choose a larger target_epsilon"
    return head + ". To reach it, use " + ", or ".join(ways) + "; or choose a larger target_epsilon"


#: Accountants whose epsilon is an approximation, not a bound: they may report, never choose the noise.
APPROXIMATE_ACCOUNTANTS = ("gdp",)


def check_calibration_accountant(name: object, argument: str = "accountant") -> str:
    """The canonical accountant name, refusing one that cannot be trusted to choose the noise.

    The GDP central-limit approximation can understate epsilon badly (at q 0.001 and 1000 steps a
    sigma it calls epsilon 1.0 has a true (PLD) epsilon of 3.69), so a noise multiplier calibrated
    with it may spend several times the target. Calibration refuses it; use PLD (the default),
    PRV or RDP, and report GDP next to them if wanted.
    """
    canonical = check_accountant_name(name, argument)
    if canonical in APPROXIMATE_ACCOUNTANTS:
        raise ValueError(
            f"{argument}={canonical!r} cannot calibrate the noise: the GDP central-limit epsilon is an approximation, "
            "not a bound, and a noise multiplier chosen with it can spend several times the target epsilon (3.7x at "
            "q 0.001, 1000 steps, target 1). Calibrate with 'pld' (the default), 'prv' or 'rdp'; the GDP "
            "approximation can still be reported next to them (dptorch epsilon --accountant gdp)"
        )
    return canonical


@lru_cache(maxsize=128)
def _calibrate(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str, tolerance: float,
    selection: Selection = POISSON,
) -> float:
    counter = create_accountant(accountant)
    counter.use_selection(selection)  # refuses an accountant that cannot compose the selection

    def epsilon_at(sigma: float, q: float, count: int) -> float:
        counter.load_state_dict({"mechanism": accountant, "history": [[sigma, q, count]],
                                 "selection": selection.as_dict()})
        with warnings.catch_warnings():
            # Far from the answer the best RDP order may sit on the grid's edge, or the PLD grid
            # grow too large: not news. An unresolvable delta ends in a ValueError that says so.
            warnings.simplefilter("ignore", RDPOrderGridWarning)
            warnings.simplefilter("ignore", DeltaResolutionWarning)
            warnings.simplefilter("ignore", PLDGridWarning)  # the RDP bound it falls back to is sound
            return counter.get_epsilon(delta)

    def epsilon_of(sigma: float) -> float:
        return epsilon_at(sigma, sample_rate, steps)

    start = _gdp_seed(target_epsilon, delta, sample_rate, steps)
    try:
        return _smallest_sigma(epsilon_of, target_epsilon, tolerance, start)
    except _Unreachable as refusal:
        raise ValueError(_unreachable_message(epsilon_at, refusal.epsilon, target_epsilon, delta, sample_rate, steps,
                                              accountant, selection.kind != "fixed_size")) from None


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    accountant: str = DEFAULT_ACCOUNTANT,
    epsilon_tolerance: float = 1e-3,
    selection: Selection = POISSON,
) -> float:
    """Smallest noise multiplier whose epsilon does not exceed ``target_epsilon``.

    Each step selects its batch by ``selection`` (default Poisson; :mod:`dptorch.accounting.selection`),
    which the accountant must be able to compose.

    Give ``steps`` or ``epochs`` (then steps = ceil(epochs / sample_rate)). The result never
    overshoots: its epsilon is in [target * (1 - epsilon_tolerance), target] (a relative
    tolerance; since epsilon falls at least as fast as 1 / sigma, a sigma smaller by that
    fraction exceeds the target). Raises ValueError for invalid input or a target no sigma up to 1e4 reaches,
    and for ``accountant="gdp"``: an approximation may report epsilon, it may not choose the noise.
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(target_delta, "target_delta")
    q = check_sample_rate(sample_rate)
    count = _resolve_steps(epochs, steps, q)
    name = check_calibration_accountant(accountant)
    tolerance = check_positive(epsilon_tolerance, "epsilon_tolerance")
    if tolerance >= 1:
        raise ValueError(f"epsilon_tolerance must be in (0, 1), got {epsilon_tolerance!r}")
    return _calibrate(target, delta, selection.check_sample_rate(q), count, name, tolerance, selection)
