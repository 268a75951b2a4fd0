"""PrivacyBudget: the accountant of a private training run, its epsilon and its cap.

Every optimizer step (one logical batch, empty or not) is recorded with the run's noise
multiplier and Poisson sample rate. ``steps_within_cap`` answers how many more steps fit under
an epsilon cap, and :class:`PrivacyBudgetCallback` stops the Trainer there: before the cap is
crossed, not after.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from transformers import TrainerCallback
from transformers.trainer_utils import SaveStrategy
from transformers.utils import logging

from dptorch.accounting import create_accountant, get_noise_multiplier

logger = logging.get_logger(__name__)


class PrivacyBudget:
    """Accountant plus (noise multiplier, sample rate, delta) of one run.

    A noise multiplier of 0 is allowed for debugging: nothing is private and epsilon is infinite.
    """

    def __init__(
        self, *, accountant: str, noise_multiplier: float, sample_rate: float, delta: float, cap: Optional[float] = None
    ) -> None:
        self.accountant = create_accountant(accountant)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.delta = float(delta)
        self.cap = cap
        self.steps = 0

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
        sigma = get_noise_multiplier(
            target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate, steps=steps,
            accountant=accountant,
        )
        return cls(accountant=accountant, noise_multiplier=sigma, sample_rate=sample_rate, delta=delta, cap=cap)

    def record_step(self) -> None:
        """One optimizer step that touched the data (or would have: empty batches count)."""
        if self.noise_multiplier > 0:
            self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self.steps += 1

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta``."""
        if self.steps == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        return self.accountant.get_epsilon(self.delta)

    def epsilon_after(self, more_steps: int) -> float:
        """Epsilon after ``more_steps`` further steps (the history is not changed)."""
        if more_steps == 0:
            return self.epsilon()
        if self.noise_multiplier == 0:
            return math.inf
        return self.accountant.epsilons_after(
            noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate, steps=[more_steps], delta=self.delta
        )[0]

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
        """Plain values, loadable with ``torch.load(weights_only=True)``."""
        return {
            "accountant": self.accountant.state_dict(),
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "delta": self.delta,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])
        self.steps = int(state["steps"])


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
