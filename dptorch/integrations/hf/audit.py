"""The private Trainer's one-run audit: ``PrivacyArguments(audit_canaries=m)``.

The DP optimizer the Trainer builds gets ``m`` gradient canaries (:mod:`dptorch.optim.canaries`);
every log entry with a training loss then holds both audited lower bounds on epsilon so far
(``audit_epsilon_steinke``, ``audit_epsilon_fdp``, at ``audit_confidence``) beside ``epsilon``, each
such audit is kept in ``trainer.dp_audit.history`` (for :func:`dptorch.auditing.plot_audit_history`),
and the privacy report (final log entry, model card) has an ``audit`` entry.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dptorch.auditing.run import RunAudit, audit_run
from dptorch.optim.canaries import CanaryError, GradientCanaries


class TrainerAudit:
    """The audit of one private Trainer's run (``trainer.dp_audit``; None without ``audit_canaries``)."""

    def __init__(self, num_canaries: int, confidence: float, seed: Optional[int]) -> None:
        self.num_canaries, self.confidence, self.seed = num_canaries, confidence, seed
        self.canaries: Optional[GradientCanaries] = None
        #: Every audit taken at a log step, in order.
        self.history: List[RunAudit] = []

    @classmethod
    def from_args(cls, privacy_args: Any) -> Optional["TrainerAudit"]:
        if not privacy_args.audit_canaries:
            return None
        return cls(privacy_args.audit_canaries, privacy_args.audit_confidence, privacy_args.audit_seed)

    def attach(self, trainer: Any, optimizer: Any) -> None:
        """Put the canaries into ``optimizer``, the Trainer's DP optimizer (refused where they cannot be added).
        Under FSDP2 the Trainer calls this once Accelerate has sharded the parameters (the canaries are cut
        along the shards each rank holds)."""
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise CanaryError("audit_canaries is refused under DeepSpeed: its partitions hold the clipped sums; audit "
                              "the same model on one process, under DDP or under FSDP2")
        self.canaries = GradientCanaries.attach(optimizer, self.num_canaries, seed=self.seed)
        self.history = []  # a new DP optimizer (a new run, e.g. a search trial): a new audit

    def waits_for_shards(self, trainer: Any) -> bool:
        """Whether the canaries wait for Accelerate's FSDP2 sharding (attached in ``_attach_to_wrapped_model``)."""
        return bool(getattr(trainer, "is_fsdp_enabled", False))

    def audit(self, trainer: Any) -> Optional[RunAudit]:
        """Both bounds for the steps so far (None before the first step)."""
        if self.canaries is None or self.canaries.steps == 0:
            return None
        return audit_run(trainer, delta=trainer.privacy_budget.delta, confidence=self.confidence)

    def logs(self, trainer: Any) -> Dict[str, float]:
        """The log entry's audit numbers; the audit is kept in ``history`` (once per step)."""
        found = self.audit(trainer)
        if found is None:
            return {}
        if not self.history or self.history[-1].step != found.step:
            self.history.append(found)
        return found.logs()

    def report(self, trainer: Any) -> Optional[Dict[str, Any]]:
        """The ``audit`` entry of the privacy report."""
        found = self.audit(trainer)
        if found is None:
            return None
        return {"claimed_epsilon": found.claimed_epsilon, "steinke_epsilon": found.steinke_epsilon,
                "fdp_epsilon": found.fdp_epsilon, "confidence": found.confidence, "delta": found.delta,
                "num_canaries": found.num_canaries, "num_included": found.num_included,
                "canary_kind": found.details["canaries"]["kind"], "steps": found.step, "consistent": found.consistent}


__all__ = ["TrainerAudit"]
