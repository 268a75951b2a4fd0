"""``model_init`` and ``hyperparameter_search`` for the private Trainer.

With ``model_init``, every ``train()`` starts a new private run on a new model: a new controller on it,
a new privacy plan (accountant, noise calibrated for this trial's batch size and epochs), a new
sampling seed and budget. ``hyperparameter_search`` then works as the Trainer's, in two ways:

* plain (``n_trials=``, any backend and sampler): every trial reports its own epsilon, and the
  search's report says that epsilon is per trial and that choosing among the trials is not accounted;
* the random-stopping protocol (``expected_trials=``, Optuna): K trials, K drawn from the OS CSPRNG
  (Poisson, or truncated negative binomial of ``trials_shape``), hyperparameters drawn independently
  (Optuna's ``RandomSampler``, no pruner), each trial refused before its first step if it would spend
  more than the trainer's own configuration (the per-trial bound); the report gives the epsilon of
  releasing the best trial, the selection included (:func:`dptorch.tuning.selection_report`), beside
  the per-trial epsilon.

Keys of the search space that name a :class:`PrivacyArguments` field (``per_sample_max_grad_norm``,
``target_epsilon``, ...) set that field for the trial; the others go to ``TrainingArguments`` as usual.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, Optional

from transformers.utils import logging

from dptorch.accounting.tuning import POISSON
from dptorch.integrations.hf.arguments import PrivacyArguments
from dptorch.integrations.hf.budget import PrivacyBudget, PrivacyBudgetCallback
from dptorch.integrations.hf.checks import check_setup
from dptorch.grad_sample.modes.auto import resolve_grad_sample_mode
from dptorch.noise import secure_seed
from dptorch.plan import check_delta_for_units
from dptorch.tuning import (
    SELECTION_NOT_ACCOUNTED,
    check_within,
    draw_trial_count,
    privacy_history,
    selection_report,
    tuning_summary,
)

logger = logging.get_logger(__name__)

PRIVACY_FIELDS = frozenset(field.name for field in dataclasses.fields(PrivacyArguments))


class PrivateSearchMixin:
    """A new private run for each model ``model_init`` builds, and the Trainer's ``hyperparameter_search``
    with the privacy of the search reported (``trainer.tuning_report``)."""

    _dp_search: Optional[Dict[str, Any]] = None  # during a search: the base privacy args, the trial's, the bound
    tuning_report: Optional[Dict[str, Any]] = None

    def hyperparameter_search(
        self,
        hp_space: Optional[Callable[[Any], Dict[str, Any]]] = None,
        compute_objective: Optional[Callable[[Dict[str, float]], float]] = None,
        n_trials: Optional[int] = None,
        direction: Any = "minimize",
        backend: Any = None,
        hp_name: Optional[Callable[[Any], str]] = None,
        *,
        expected_trials: Optional[float] = None,
        trials_shape: float = POISSON,
        **kwargs: Any,
    ) -> Any:
        """The Trainer's search. ``expected_trials=`` runs the random-stopping protocol (see the module
        docstring); ``n_trials=`` (default 20) a plain search whose epsilon is per trial. Returns the
        Trainer's ``BestRun`` (None when the protocol drew no trial); the privacy is ``trainer.tuning_report``."""
        if expected_trials is not None and n_trials is not None:
            raise ValueError("pass n_trials (a plain search, epsilon per trial) or expected_trials (the random-stopping "
                             "protocol, the selection accounted), not both")
        if self.model_init is None:
            raise RuntimeError("hyperparameter_search needs model_init=...: each trial trains a new model privately")
        base = self.privacy_args
        self._dp_search = {"base": base, "trial": {}, "epsilons": [], "bound": None}
        search_space = hp_space  # None: the Trainer's default space (learning rate, epochs, seed, batch size)
        try:
            if expected_trials is None:
                trials = 20 if n_trials is None else n_trials
                self.tuning_report = {"per_trial_epsilon": None, "delta": base.target_delta, "trials": trials,
                                      "selection_accounted": False}  # (what the trials' model cards say)
                best = super().hyperparameter_search(
                    _split_space(self, search_space), compute_objective, trials, direction, backend, hp_name, **kwargs)
                epsilons = self._dp_search["epsilons"]
                self.tuning_report = {"per_trial_epsilon": max(epsilons) if epsilons else 0.0,
                                      "delta": base.target_delta, "trials": len(epsilons), "selection_accounted": False}
                warnings.warn(SELECTION_NOT_ACCOUNTED, UserWarning, stacklevel=2)
            else:
                self._check_protocol(backend, direction, kwargs)
                plan = self.privacy_plan
                bound = [(plan.noise_multiplier, plan.sample_rate, self.sampling_plan.total_steps)]
                self._dp_search["bound"] = bound
                self.tuning_report = selection_report(bound, expected_trials=expected_trials, shape=trials_shape,
                                                      delta=base.target_delta, accountant=base.accountant)
                trials = draw_trial_count(expected_trials, trials_shape)
                best = None
                if trials:
                    import optuna  # optional dependency (the tune extra), checked by _check_protocol

                    best = super().hyperparameter_search(
                        _split_space(self, search_space), compute_objective, trials, direction, "optuna", hp_name,
                        sampler=optuna.samplers.RandomSampler(seed=secure_seed(32)),
                        pruner=optuna.pruners.NopPruner(), **kwargs)
        finally:
            self._dp_search = None
            self.privacy_args = base
        logger.info("hyperparameter search: %s", tuning_summary(self.tuning_report))
        return best

    def _check_protocol(self, backend: Any, direction: Any, kwargs: Dict[str, Any]) -> None:
        """Refuse what the random-stopping bound does not cover, before any trial."""
        try:
            import optuna  # noqa: F401  (optional dependency: the tune extra)
        except ImportError as error:
            raise ImportError("the random-stopping protocol runs on Optuna: pip install 'dptorch[tune]'") from error
        p = self.privacy_args
        refusals = [
            (backend not in (None, "optuna") and str(getattr(backend, "value", backend)) != "optuna",
             f"backend={backend!r}: the protocol runs on Optuna (backend='optuna')"),
            (not isinstance(direction, str), "several objectives: the protocol releases the best by one score"),
            (kwargs.get("sampler") is not None, "sampler=: the bound holds for independent trials; the protocol uses "
             "Optuna's RandomSampler (an adaptive sampler such as TPE chooses from earlier trials' scores)"),
            (kwargs.get("pruner") is not None, "pruner=: a pruner stops a trial by other trials' scores; the protocol "
             "runs every trial to its end"),
            (kwargs.get("timeout") is not None, "timeout=: the number of trials must be the drawn one"),
            (kwargs.get("catch"), "catch=: a failed trial must stop the search, not shorten it"),
            (kwargs.get("n_jobs", 1) != 1, "n_jobs: one trainer runs one trial at a time"),
            (p.noise_seed is not None or p.sampling_seed is not None,
             "noise_seed / sampling_seed: the trials must draw independent, secret noise and batches"),
            (p.banded is not None, "noise_mechanism='bandmf': the per-trial bound is DP-SGD's"),
            (self.privacy_plan.shuffled, "shuffled sampling: the per-trial bound is Poisson-sampled DP-SGD's"),
        ]
        problems = [message for refused, message in refusals if refused]
        if problems:
            raise ValueError("cannot run the random-stopping protocol with:\n" + "\n".join(f"  - {m}" for m in problems))

    # ------------------------------------------------------------------ a new private run per model

    def _hp_search_setup(self, trial: Any) -> None:
        super()._hp_search_setup(trial)
        if self.model_init is not None and self.privacy_plan is not None:
            self._new_private_run()

    def _new_private_run(self) -> None:
        """The model is new (``model_init``): a new plan, budget, seed, controller and sampler for it. Under the
        protocol, a trial above the per-trial bound is refused here, before its first step."""
        search = self._dp_search
        privacy_args = self.privacy_args
        if search is not None:
            privacy_args = dataclasses.replace(search["base"], **search["trial"])
        check_setup(self, privacy_args)
        self.privacy_args = privacy_args
        self.sampling_plan = self._sampling_plan(privacy_args.banded)
        self.privacy_plan = self._build_plan()
        check_delta_for_units(privacy_args.target_delta, self.privacy_units.num_units, "target_delta")
        if search is not None and search["bound"] is not None:
            planned = [(self.privacy_plan.noise_multiplier, self.privacy_plan.sample_rate,
                        self.sampling_plan.total_steps)]
            check_within(planned, search["bound"], what="this trial's configuration")
        self.pop_callback(PrivacyBudgetCallback)
        self.privacy_budget = PrivacyBudget(plan=self.privacy_plan, delta=privacy_args.target_delta,
                                            cap=privacy_args.budget_cap)
        self.add_callback(PrivacyBudgetCallback(self.privacy_budget))
        seed = privacy_args.sampling_seed
        self._dp_sampling_seed = seed if seed is not None else secure_seed()
        self._dp_sampler, self._dp_wrapped, self._dp_ddp_switches, self._dp_on_shards = None, None, [], False
        self._dp_grad_norm, self._dp_clipping_logs = None, {}
        self.grad_sample_mode = resolve_grad_sample_mode(privacy_args.grad_sample_mode, self.model)
        self.dp_hooks.cleanup()
        self.dp_hooks = self._new_controller()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        output = super().train(*args, **kwargs)
        search = self._dp_search
        if search is not None:  # a trial of a search: its epsilon, and (protocol) what it spent within the bound
            search["epsilons"].append(self.get_epsilon())
            if search["bound"] is not None:
                check_within(privacy_history(self.privacy_plan), search["bound"], what="the trial")
        return output


def _split_space(trainer: Any, space: Optional[Callable[[Any], Dict[str, Any]]]) -> Optional[Callable]:
    """``space`` with the keys that name a PrivacyArguments field (and no TrainingArguments one) kept for the
    trial's privacy arguments; the rest go to the Trainer."""
    if space is None:
        return None

    def training_part(trial: Any) -> Dict[str, Any]:
        params = dict(space(trial))
        privacy = {key: params.pop(key) for key in list(params)
                   if key in PRIVACY_FIELDS and not hasattr(trainer.args, key)}
        if trainer._dp_search is not None:
            trainer._dp_search["trial"] = privacy
        return params

    return training_part

