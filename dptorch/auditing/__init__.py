"""Empirical privacy auditing: lower bounds on epsilon from one training run.

The user's own run: ``make_private(..., audit_canaries=m)`` or ``PrivacyArguments(audit_canaries=m)``
puts white-box gradient canaries into every private step (:mod:`dptorch.optim.canaries`), and
:func:`audit_run` turns their scores into two lower bounds at a stated confidence, Steinke, Nasr and
Jagielski's (2023) and the f-DP one of Mahloujifar, Melis and Chaudhuri (2025), beside the claimed
epsilon (:class:`RunAudit`); :func:`plot_audit_history` draws them over the run. The library itself:
:func:`audit_dp_sgd` trains a small model with Dirac canaries through the real DP-SGD pipeline
(:class:`AuditResult`), ``dptorch audit`` runs it from the command line. :func:`epsilon_lower_bound`
and :func:`bounds_from_scores` audit scores of any experiment. See docs/auditing.md.
"""

from dptorch.auditing.bounds import epsilon_lower_bound, one_run_epsilon, one_run_p_value
from dptorch.auditing.canaries import AuditResult, audit_dp_sgd
from dptorch.auditing.fdp import fdp_one_run_epsilon
from dptorch.auditing.plot import plot_audit, plot_audit_history
from dptorch.auditing.run import RunAudit, audit_run
from dptorch.auditing.scores import bounds_from_scores

__all__ = ["AuditResult", "RunAudit", "audit_dp_sgd", "audit_run", "bounds_from_scores", "epsilon_lower_bound",
           "fdp_one_run_epsilon", "one_run_epsilon", "one_run_p_value", "plot_audit", "plot_audit_history"]
