"""The audit of a real run: the gradient canaries' scores so far into both lower bounds on epsilon.

``make_private(..., audit_canaries=m)`` (or the private Trainer's ``PrivacyArguments(audit_canaries=m)``)
puts ``m`` gradient canaries into every private step of the user's own model
(:mod:`dptorch.optim.canaries`); :func:`audit_run` reads their scores at any point of the run and
returns a :class:`RunAudit`: Steinke et al.'s and the f-DP lower bound (:mod:`dptorch.auditing.scores`)
beside the epsilon the accountant claims for the steps so far. The steps so far are themselves a
private run, so an audit taken mid-run is as valid as one at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from dptorch.auditing.serialize import Serializable
from dptorch.auditing.scores import bounds_from_scores


@dataclass
class RunAudit(Serializable):
    """Both audited lower bounds of a run at one step, against the claimed epsilon."""

    step: int
    claimed_epsilon: float
    steinke_epsilon: float
    fdp_epsilon: float
    delta: float
    confidence: float
    num_canaries: int
    num_included: int
    details: Dict[str, Any] = field(default_factory=dict)

    @property
    def consistent(self) -> bool:
        """True when neither bound refutes the claim (both at or below the claimed epsilon)."""
        return max(self.steinke_epsilon, self.fdp_epsilon) <= self.claimed_epsilon

    def logs(self) -> Dict[str, float]:
        """The numbers a training log shows."""
        return {"audit_epsilon_steinke": self.steinke_epsilon, "audit_epsilon_fdp": self.fdp_epsilon}



def audit_run(
    run: Any,
    *,
    delta: float,
    confidence: float = 0.95,
    claimed_epsilon: Optional[float] = None,
) -> RunAudit:
    """Audit ``run`` (a ``PrivacyEngine`` made private with ``audit_canaries=m``, or a private Trainer with
    ``PrivacyArguments(audit_canaries=m)``) at the steps taken so far.

    ``claimed_epsilon`` defaults to ``run.get_epsilon(delta)``. The canaries are units of the run's
    dataset, which has ``N + m`` of them, so ``delta`` must be below ``1 / (N + m)``.
    """
    canaries = getattr(run, "audit_canaries", None)
    if canaries is None:
        raise ValueError("audit_run: the run has no audit canaries; make it private with audit_canaries=m "
                         "(PrivacyArguments(audit_canaries=m) for the private Trainer)")
    if canaries.steps == 0:
        raise ValueError("audit_run: no private step has been taken yet, so there is nothing to audit")
    plan = getattr(run, "plan", None) or getattr(run, "privacy_plan", None)
    units = getattr(plan, "num_units", None)
    if units and delta * (units + canaries.num_canaries) >= 1:
        raise ValueError(f"delta={delta:g} is not below 1 / (N + m) = 1 / ({units} + {canaries.num_canaries}): the "
                         "canaries are units of the run's dataset too")
    claimed = run.get_epsilon(delta) if claimed_epsilon is None else float(claimed_epsilon)
    found = bounds_from_scores(canaries.scores.tolist(), canaries.included.tolist(), delta=delta, confidence=confidence)
    summary = canaries.summary()
    details = {"canaries": summary, "significance_per_test": found["significance_per_test"], "grid": found["grid"],
               **{name: {k: v for k, v in found[name].items() if k != "guesses"} for name in ("steinke", "fdp")}}
    return RunAudit(step=canaries.steps, claimed_epsilon=claimed, steinke_epsilon=found["steinke"]["epsilon_lower_bound"],
                    fdp_epsilon=found["fdp"]["epsilon_lower_bound"], delta=delta, confidence=confidence,
                    num_canaries=summary["num_canaries"], num_included=summary["num_included"], details=details)


__all__ = ["RunAudit", "audit_run"]
