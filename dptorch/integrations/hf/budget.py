"""PrivacyBudget: the accountant of a private training run, its epsilon and its cap.

Every optimizer step (one logical batch, empty or not) is recorded with the run's noise
multiplier and Poisson sample rate. ``steps_within_cap`` answers how many more steps fit under
an epsilon cap, so the trainer can stop before the cap is crossed rather than after.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from dptorch.accounting import create_accountant, get_noise_multiplier


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
        cls, *, accountant: str, target_epsilon: float, sample_rate: float, delta: float, steps: int, cap: Optional[float]
    ) -> "PrivacyBudget":
        """A budget whose noise multiplier makes ``steps`` steps spend ``target_epsilon``."""
        sigma = get_noise_multiplier(
            target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant
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
