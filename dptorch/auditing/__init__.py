"""Empirical privacy auditing: a lower bound on epsilon from one training run.

:func:`audit_dp_sgd` trains a small model with white-box Dirac gradient canaries through the real
DP-SGD pipeline and returns an :class:`AuditResult` (the audited lower bound, at a stated
confidence, against the accountant's claimed epsilon); :func:`epsilon_lower_bound` turns any
canary scores into such a bound (Steinke, Nasr and Jagielski 2023); :func:`plot_audit` draws
claimed against audited. ``dptorch audit`` runs it from the command line. See docs/auditing.md.
"""

from dptorch.auditing.bounds import epsilon_lower_bound, one_run_epsilon, one_run_p_value
from dptorch.auditing.canaries import AuditResult, audit_dp_sgd
from dptorch.auditing.plot import plot_audit

__all__ = ["AuditResult", "audit_dp_sgd", "epsilon_lower_bound", "one_run_epsilon", "one_run_p_value", "plot_audit"]
