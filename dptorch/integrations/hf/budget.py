"""PrivacyBudget: the epsilon of a private training run's plan, and its cap.

Every optimizer step (one logical batch, empty or not) is recorded by the DP optimizer in the
run's :class:`~dptorch.plan.PrivacyPlan`, with its noise multiplier and Poisson sample rate. ``steps_within_cap`` answers how many more steps fit under
an epsilon cap, and :class:`PrivacyBudgetCallback` stops the Trainer there: before the cap is
crossed, not after.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from transformers import TrainerCallback
from transformers.trainer_utils import SaveStrategy
from transformers.utils import logging

from dptorch.plan import PrivacyPlan

logger = logging.get_logger(__name__)


class PrivacyBudget:
    """A privacy plan's epsilon at the run's ``delta``, and the cap that training must not cross.

    The noise multiplier, sample rate, steps and accountant are the plan's (``budget.plan``, a
    :class:`~dptorch.plan.PrivacyPlan`, shared with the sampler, the optimizer and the report); the
    budget adds only ``delta`` and ``cap``. Built either from a plan or, for accounting on its own,
    from ``accountant``, ``noise_multiplier`` and ``sample_rate``. A noise multiplier of 0 is
    allowed for debugging: nothing is private and epsilon is infinite.
    """

    def __init__(
        self,
        *,
        delta: float,
        cap: Optional[float] = None,
        plan: Optional[PrivacyPlan] = None,
        accountant: Optional[str] = None,
        noise_multiplier: Optional[float] = None,
        sample_rate: Optional[float] = None,
    ) -> None:
        if plan is None:
            if accountant is None or noise_multiplier is None or sample_rate is None:
                raise TypeError("PrivacyBudget needs plan=, or accountant, noise_multiplier and sample_rate")
            plan = PrivacyPlan(noise_multiplier=noise_multiplier, sample_rate=sample_rate, accountant=accountant)
        elif not (accountant is None and noise_multiplier is None and sample_rate is None):
            raise TypeError("give either plan= or accountant, noise_multiplier and sample_rate: the plan holds them")
        self.plan = plan
        self.delta = float(delta)
        self.cap = cap

    @classmethod
    def calibrated(
        cls,
        *,
        accountant: str,
        target_epsilon: float,
        sample_rate: float,
        delta: float,
        steps: int,
        cap: Optional[float],
    ) -> "PrivacyBudget":
        """A budget whose noise multiplier makes ``steps`` steps spend ``target_epsilon``."""
        plan = PrivacyPlan.calibrated(target_epsilon=target_epsilon, target_delta=delta, steps=steps,
                                      sample_rate=sample_rate, accountant=accountant)
        return cls(plan=plan, delta=delta, cap=cap)

    @property
    def accountant(self):
        return self.plan.accountant

    @property
    def noise_multiplier(self) -> float:
        return self.plan.noise_multiplier

    @property
    def sample_rate(self) -> float:
        return self.plan.sample_rate

    @property
    def steps(self) -> int:
        """Optimizer steps accounted so far (empty batches included)."""
        return self.plan.steps

    def record_step(self) -> None:
        """One optimizer step that touched the data (or would have: empty batches count).

        The private Trainer's optimizer records its steps in the plan itself; this is for
        accounting without an optimizer.
        """
        self.plan.record_steps(1)

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta``."""
        return self.plan.epsilon(self.delta)

    def epsilon_after(self, more_steps: int) -> float:
        """Epsilon after ``more_steps`` further steps (the history is not changed)."""
        return self.plan.epsilon_after(more_steps, self.delta)

    def steps_within_cap(self, planned: int) -> int:
        """The most further steps, at most ``planned``, that keep epsilon <= cap (``planned`` without a cap)."""
        if self.cap is None or planned <= 0 or self.epsilon_after(planned) <= self.cap:
            return max(planned, 0)
        low, high = 0, planned  # epsilon_after(low) <= cap < epsilon_after(high)
        if self.epsilon() > self.cap:
            return 0
        while high - low > 1:
            middle = (low + high) // 2
            if self.epsilon_after(middle) <= self.cap:
                low = middle
            else:
                high = middle
        return low

    def state_dict(self) -> Dict[str, Any]:
        """Plain values, loadable with ``torch.load(weights_only=True)``: the plan's state and delta."""
        return {"plan": self.plan.state_dict(), "delta": self.delta}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "plan" in state:
            self.plan.load_state_dict(state["plan"])
        else:  # written before budgets kept a plan
            self.plan.accountant.load_state_dict(state["accountant"])
            self.plan.steps = int(state["steps"])


class PrivacyBudgetCallback(TrainerCallback):
    """Ends training at the last step whose epsilon stays within the budget's cap.

    At the start of ``train()`` (after a resume has restored the accountant) it works out how
    many of the remaining steps fit under the cap; it refuses to start when none does.
    """

    def __init__(self, budget: PrivacyBudget) -> None:
        self.budget = budget
        self.last_step: Optional[int] = None

    def on_train_begin(self, args, state, control, **kwargs):
        remaining = max(state.max_steps - state.global_step, 0)
        allowed = self.budget.steps_within_cap(remaining)
        if remaining > 0 and allowed == 0:
            raise ValueError(
                f"the privacy budget is spent: epsilon is {self.budget.epsilon():.4g} after {self.budget.steps} steps "
                f"and one more step would exceed the cap of {self.budget.cap:g}; raise max_epsilon or stop here"
            )
        self.last_step = state.global_step + allowed
        if allowed < remaining:
            logger.warning(
                "training will stop after step %d of %d: later steps would take epsilon above %g",
                self.last_step, state.max_steps, self.budget.cap,
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self.last_step is not None and self.last_step <= state.global_step < state.max_steps:
            control.should_training_stop = True
            if args.save_strategy != SaveStrategy.NO:
                control.should_save = True
