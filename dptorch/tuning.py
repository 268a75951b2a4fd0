"""Private hyperparameter tuning: a random number of private trials, and only the best released.

:func:`tune` runs the random-stopping protocol of Papernot and Steinke (ICLR 2022): it draws the
number of trials K (Poisson, or truncated negative binomial) from the OS CSPRNG, runs K independent
trials, and returns the best one by its score with the epsilon of that release, the selection
included, beside the epsilon of one trial alone. The math is :mod:`dptorch.accounting.tuning`.

What the guarantee needs, and what is checked:

* every trial spends at most the declared per-trial privacy (``per_trial``): each trial's own
  accountant is compared with it, order by order, and a trial above it is refused;
* the trials are independent: each draws its hyperparameters afresh (``candidates`` are drawn
  uniformly at random), never from earlier trials' results (no adaptive search);
* only the best trial's output and score are released: the other trials, and K itself, are not
  covered and are not returned;
* the score is computed on data outside the private dataset (or privately, as part of the trial).
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dptorch.accounting.base import Accountant
from dptorch.accounting.factory import DEFAULT_ACCOUNTANT, create_accountant
from dptorch.accounting.rdp import RDPAccountant
from dptorch.accounting.sampled_gaussian_rdp import DEFAULT_ORDERS, rdp_to_epsilon
from dptorch.accounting.tuning import POISSON, check_trials, repeat_and_select_rdp, trial_count
from dptorch.accounting.validation import check_delta
from dptorch.noise import secure_uniforms

logger = logging.getLogger(__name__)

#: Said wherever an epsilon covers one trial only (a plain search, every trial reported).
SELECTION_NOT_ACCOUNTED = (
    "epsilon is per trial: choosing among the trials is not accounted, and the released model's privacy is worse "
    "than any one trial's. Run the random-stopping protocol (expected_trials=...) to account the selection"
)


def distribution_name(shape: float) -> str:
    """The name of K's distribution for ``shape``."""
    names = {POISSON: "Poisson", 0: "logarithmic", 1: "geometric"}
    return names.get(shape, f"truncated negative binomial (shape {shape:g})")


def draw_trial_count(expected_trials: float, shape: float = POISSON, *, secure: bool = True,
                     seed: Optional[int] = None) -> int:
    """K, the number of trials: from the OS CSPRNG (``secure``, the default) or from ``random.Random(seed)``.

    K is part of the mechanism: a K known to an observer is not covered by the bound."""
    check_trials(expected_trials, shape)
    if secure and seed is not None:
        raise ValueError("a seed makes K replayable: pass secure=False with seed=..., or no seed")
    if secure:
        uniform = float(secure_uniforms(1)[0])  # strictly inside (0, 1)
    else:
        uniform = (random.Random(seed).getrandbits(53) + 0.5) / 2**53
    return trial_count(expected_trials, shape, uniform)


History = List[Tuple[float, float, int]]


def privacy_history(privacy: Any) -> History:
    """The (noise multiplier, sample rate, steps) runs of a trial's privacy: a ``PrivacyEngine``, a
    ``PrivacyPlan``, an ``Accountant``, or such a list itself. Steps without noise are refused."""
    if privacy is None:
        raise ValueError("a trial's privacy is required (its PrivacyEngine, PrivacyPlan or accountant): the bound "
                         "holds only for trials checked to stay within the per-trial privacy")
    plan = getattr(privacy, "plan", None) or privacy
    if getattr(plan, "unprotected_steps", 0):
        raise ValueError("a trial ran steps without noise (noise_multiplier=0): its epsilon is infinite, and so is "
                         "the tuning's")
    accountant = getattr(plan, "accountant", plan)
    entries = accountant.history if isinstance(accountant, Accountant) else privacy
    return [(float(sigma), float(q), int(count)) for sigma, q, count in entries]


def history_rdp(history: History, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP at ``orders`` of the composed runs of ``history`` (Poisson-sampled Gaussian steps)."""
    accountant = RDPAccountant(orders)
    accountant.history = [list(entry) for entry in history]
    return accountant.get_rdp()


def history_epsilon(history: History, delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """Epsilon of ``history`` at ``delta`` by the named accountant (what one run reports)."""
    counter = create_accountant(accountant)
    counter.history = [list(entry) for entry in history]
    return counter.get_epsilon(delta)


def selection_report(per_trial: Any, *, expected_trials: float, delta: float, shape: float = POISSON,
                     accountant: str = DEFAULT_ACCOUNTANT, orders: Sequence[float] = DEFAULT_ORDERS) -> Dict[str, Any]:
    """The labelled privacy of releasing the best of K trials, each within ``per_trial``:

    ``epsilon`` (the release, selection included: RDP, Papernot and Steinke 2022), ``per_trial_epsilon``
    (one trial alone, by ``accountant``), ``per_trial_epsilon_rdp`` (one trial through RDP, where the
    bound starts), ``delta``, ``expected_trials``, ``trials_distribution``, ``selection_accounted`` (True)."""
    delta = check_delta(delta)
    check_trials(expected_trials, shape)
    history = privacy_history(per_trial)
    rdp = history_rdp(history, orders)
    return {
        "epsilon": rdp_to_epsilon(repeat_and_select_rdp(rdp, orders, expected_trials, shape), orders, delta)[0],
        "per_trial_epsilon": history_epsilon(history, delta, accountant),
        "per_trial_epsilon_rdp": rdp_to_epsilon(rdp, orders, delta)[0],
        "delta": delta,
        "expected_trials": float(expected_trials),
        "trials_distribution": distribution_name(shape),
        "selection_accounted": True,
    }


def check_within(history: History, bound: History, orders: Sequence[float] = DEFAULT_ORDERS,
                 what: str = "the trial") -> None:
    """Refuse ``history`` if its RDP exceeds the bound's at any order (the selection's epsilon assumes it)."""
    spent, allowed = history_rdp(history, orders), history_rdp(bound, orders)
    above = np.flatnonzero(spent > allowed * (1 + 1e-12))
    if above.size:
        order = orders[int(above[0])]
        raise ValueError(
            f"{what} spends more privacy than the per-trial bound the tuning's epsilon was computed with (RDP "
            f"{spent[above[0]]:.4g} > {allowed[above[0]]:.4g} at order {order:g}; its runs {history}, the bound's "
            f"{bound}): tune only what costs no privacy (learning rate, clipping bound, ...), or declare the "
            "largest trial as the bound"
        )


@dataclass(frozen=True)
class TrialOutcome:
    """What one trial returns: its ``output`` (a model, its weights), its ``score`` (computed on data outside
    the private dataset) and its ``privacy`` (the trial's ``PrivacyEngine``, ``PrivacyPlan`` or accountant)."""

    output: Any
    score: float
    privacy: Any = None


@dataclass(frozen=True)
class TuningResult:
    """The released best trial (``output``, ``score``; None when K was 0) and the labelled privacy of the release
    (``report``: :func:`selection_report`)."""

    output: Any
    score: Optional[float]
    params: Any
    report: Dict[str, Any]

    @property
    def epsilon(self) -> float:
        """Epsilon of the release, the selection included."""
        return self.report["epsilon"]

    @property
    def per_trial_epsilon(self) -> float:
        """Epsilon of one trial alone (not the release's)."""
        return self.report["per_trial_epsilon"]

    def summary(self) -> str:
        return tuning_summary(self.report)


def tuning_summary(report: Dict[str, Any]) -> str:
    """One line saying what the epsilon covers."""
    if not report.get("selection_accounted"):
        return f"epsilon = {report['per_trial_epsilon']:.4g} at delta = {report['delta']:g} per trial; " \
               + SELECTION_NOT_ACCOUNTED
    return (f"epsilon = {report['epsilon']:.4g} at delta = {report['delta']:g} for the best of a random number of "
            f"trials ({report['trials_distribution']}, mean {report['expected_trials']:g}), the selection included "
            f"(RDP, Papernot and Steinke 2022); one trial alone: epsilon = {report['per_trial_epsilon']:.4g} "
            f"(per trial, {report['per_trial_epsilon_rdp']:.4g} through RDP)")


def _better(score: float, best: Optional[float], maximize: bool) -> bool:
    if math.isnan(score):
        return False
    return best is None or (score > best if maximize else score < best)


def tune(
    run_trial: Callable[..., TrialOutcome],
    *,
    per_trial: Any,
    expected_trials: float,
    delta: float,
    shape: float = POISSON,
    candidates: Optional[Sequence[Any]] = None,
    maximize: bool = False,
    secure: bool = True,
    seed: Optional[int] = None,
    accountant: str = DEFAULT_ACCOUNTANT,
) -> TuningResult:
    """Run K independent trials, K drawn with mean ``expected_trials`` (``shape``: :data:`POISSON`, or the
    truncated negative binomial's, 0 logarithmic, 1 geometric), and release the best by score.

    ``run_trial(candidate)`` (one of ``candidates``, drawn uniformly at random for each trial) or ``run_trial()``
    trains one model privately and returns a :class:`TrialOutcome`. ``per_trial`` declares what one trial may
    spend (a ``PrivacyPlan``, accountant, or ``[(noise_multiplier, sample_rate, steps)]``); a trial that spends
    more is refused. ``secure`` draws K and the candidates from the OS CSPRNG; ``secure=False, seed=...`` replays
    them (tests). The result holds the best trial only, and the epsilon of releasing it at ``delta``."""
    report = selection_report(per_trial, expected_trials=expected_trials, delta=delta, shape=shape,
                              accountant=accountant)
    bound = privacy_history(per_trial)
    trials = draw_trial_count(expected_trials, shape, secure=secure, seed=seed)
    chooser = random.SystemRandom() if secure else random.Random(None if seed is None else seed + 1)
    best: Optional[TrialOutcome] = None
    best_params: Any = None
    for number in range(trials):
        params = chooser.choice(list(candidates)) if candidates is not None else None
        logger.info("private tuning: trial %d (of a random number, mean %g)%s", number + 1, expected_trials,
                    f", {params!r}" if candidates is not None else "")
        outcome = run_trial(params) if candidates is not None else run_trial()
        if not isinstance(outcome, TrialOutcome):
            raise TypeError(f"run_trial must return a TrialOutcome(output, score, privacy), got {type(outcome).__name__}")
        check_within(privacy_history(outcome.privacy), bound, what=f"trial {number + 1}")
        if _better(float(outcome.score), None if best is None else float(best.score), maximize):
            best, best_params = outcome, params
    result = TuningResult(output=None if best is None else best.output,
                          score=None if best is None else float(best.score), params=best_params, report=report)
    logger.info("private tuning: %s", result.summary())
    return result
