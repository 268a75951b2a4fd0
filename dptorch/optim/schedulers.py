"""Noise-multiplier and clipping-bound schedules over a run (Opacus' ``opacus.schedulers``).

A scheduler is stepped between optimizer steps (usually once per epoch, as torch's LR schedulers
are) and writes ``optimizer.noise_multiplier`` or ``optimizer.max_grad_norm``. Each value is a pure
function of the base value (the optimizer's when the scheduler was built) and the scheduler's epoch,
so a resumed run (``load_state_dict``) continues with exactly the value it had.

Privacy: every accountant records each step with the noise multiplier that step used (the plan
reads it at ``step()``), so a noise schedule is accounted step by step; ``epsilon_after`` forecasts
at the current value. What the library cannot keep sound is refused when the scheduler is built:
a noise schedule on a run calibrated to a target epsilon (``make_private_with_epsilon`` chose one
constant noise multiplier for that target; a schedule would miss it), a noise schedule under
``mechanism="bandmf"`` (its correlated noise is accounted at one noise multiplier), and a
clipping schedule under adaptive or automatic clipping (the bound is the rule's) or per-layer
bounds. The optimizer itself refuses a new clipping bound while clipped gradients are held for the
next step (they were clipped at the old bound, the noise would be drawn at the new one).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

#: Clipping modes whose one float bound a clipping schedule may move.
_SCHEDULABLE_CLIPPING = ("flat",)


class _Scheduler:
    """Writes ``base * factor(epoch)`` to the optimizer's ``attribute`` at every ``step()``.

    Built at ``last_epoch=-1`` it takes the optimizer's value as the base and steps once (epoch 0,
    factor 1), as Opacus' schedulers do.
    """

    attribute = ""

    def __init__(self, optimizer: Any, *, last_epoch: int = -1):
        if not hasattr(optimizer, self.attribute):
            raise TypeError(
                f"{type(self).__name__} needs an optimizer with a {self.attribute!r} attribute: pass the DPOptimizer "
                "that make_private returned, not the torch optimizer inside it"
            )
        self._check(optimizer)
        self.optimizer = optimizer
        self.base = float(getattr(optimizer, self.attribute))
        self.last_epoch = last_epoch
        self.step()

    def _check(self, optimizer: Any) -> None:
        """Refuse an optimizer whose value this schedule may not move (before anything changes)."""

    def factor(self, epoch: int) -> float:
        """The schedule: the base value's multiplier at ``epoch`` (1 at epoch 0)."""
        raise NotImplementedError

    def value(self) -> float:
        """The scheduled value at the current epoch."""
        return self.base * self.factor(self.last_epoch)

    def step(self) -> None:
        """Advance one epoch and write the new value to the optimizer."""
        self.last_epoch += 1
        setattr(self.optimizer, self.attribute, self.value())

    def state_dict(self) -> Dict[str, Any]:
        """Plain values: base, epoch and the schedule's numbers (not the optimizer, not a function)."""
        return {key: value for key, value in vars(self).items() if key != "optimizer" and not callable(value)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the schedule and write its current value to the optimizer (a resumed run goes on exactly)."""
        vars(self).update({key: value for key, value in state_dict.items() if key != "optimizer"})
        if "base_noise_multiplier" in state_dict or "base_max_grad_norm" in state_dict:  # an Opacus state
            self.base = float(state_dict.get("base_noise_multiplier", state_dict.get("base_max_grad_norm")))
        if self.last_epoch >= 0:
            setattr(self.optimizer, self.attribute, self.value())


def _check_gamma(gamma: Any) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > 0:
        raise ValueError(f"gamma must be a number > 0, got {gamma!r}")
    return float(gamma)


def _check_step_size(step_size: Any) -> int:
    if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
        raise ValueError(f"step_size must be an integer >= 1, got {step_size!r}")
    return step_size


class _NoiseScheduler(_Scheduler):
    """Base of the noise-multiplier schedules (each step is accounted at its own value)."""

    attribute = "noise_multiplier"

    def _check(self, optimizer: Any) -> None:
        plan = getattr(optimizer, "plan", None)
        if plan is None:
            return
        if getattr(plan, "target_epsilon", None) is not None:
            raise ValueError(
                f"{type(self).__name__} on a run calibrated to target_epsilon={plan.target_epsilon}: "
                "make_private_with_epsilon chose one constant noise multiplier for that target, and a schedule "
                "would miss it. Use make_private(noise_multiplier=...) with the schedule's base value; every "
                "step is accounted at its own noise multiplier, and get_epsilon(delta) reports the total"
            )
        if getattr(plan, "mechanism", "gaussian") == "bandmf":
            raise ValueError(
                f"{type(self).__name__} under mechanism='bandmf': the correlated noise of a band window is accounted "
                "as one Gaussian of a single noise multiplier. Keep it constant, or use mechanism='gaussian'"
            )

    def get_noise_multiplier(self) -> float:
        """Opacus' name for the scheduled value."""
        return self.value()


class _GradClipScheduler(_Scheduler):
    """Base of the clipping-bound schedules (the noise std follows the bound, so each step's epsilon is unchanged)."""

    attribute = "max_grad_norm"

    def _check(self, optimizer: Any) -> None:
        clipping = getattr(optimizer, "clipping", "flat")
        if clipping not in _SCHEDULABLE_CLIPPING:
            raise ValueError(
                f"{type(self).__name__} needs flat clipping (one float max_grad_norm), got clipping={clipping!r}: "
                "adaptive clipping moves the bound by its own private rule, automatic clipping has no bound, and "
                "per-layer bounds are a list. Use clipping='flat' to schedule the bound"
            )

    def get_max_grad_norm(self) -> float:
        """Opacus' name for the scheduled value."""
        return self.value()


class _Exponential:
    """``base * gamma ** epoch`` (mixed into a noise or a clipping scheduler)."""

    def __init__(self, optimizer: Any, *, gamma: float, last_epoch: int = -1):
        self.gamma = _check_gamma(gamma)
        super().__init__(optimizer, last_epoch=last_epoch)  # type: ignore[call-arg]

    def factor(self, epoch: int) -> float:
        return self.gamma ** epoch


class _Stepwise:
    """``base * gamma ** (epoch // step_size)`` (mixed into a noise or a clipping scheduler)."""

    def __init__(self, optimizer: Any, *, step_size: int, gamma: float, last_epoch: int = -1):
        self.step_size = _check_step_size(step_size)
        self.gamma = _check_gamma(gamma)
        super().__init__(optimizer, last_epoch=last_epoch)  # type: ignore[call-arg]

    def factor(self, epoch: int) -> float:
        return self.gamma ** (epoch // self.step_size)


def _check_function(function: Any, name: str) -> Callable[[int], float]:
    if not callable(function):
        raise TypeError(f"{name} must be a function of the epoch, got {function!r}")
    return function


class ExponentialNoise(_Exponential, _NoiseScheduler):
    """``noise_multiplier = base * gamma ** epoch``."""


class StepNoise(_Stepwise, _NoiseScheduler):
    """``noise_multiplier = base * gamma ** (epoch // step_size)``."""


class LambdaNoise(_NoiseScheduler):
    """``noise_multiplier = base * noise_lambda(epoch)`` (a result of 0 takes unprotected steps: epsilon infinite)."""

    def __init__(self, optimizer: Any, *, noise_lambda: Callable[[int], float], last_epoch: int = -1):
        self.noise_lambda = _check_function(noise_lambda, "noise_lambda")
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return float(self.noise_lambda(epoch))


class ExponentialGradClip(_Exponential, _GradClipScheduler):
    """``max_grad_norm = base * gamma ** epoch``."""


class StepGradClip(_Stepwise, _GradClipScheduler):
    """``max_grad_norm = base * gamma ** (epoch // step_size)``."""


class LambdaGradClip(_GradClipScheduler):
    """``max_grad_norm = base * scheduler_function(epoch)``."""

    def __init__(self, optimizer: Any, *, scheduler_function: Callable[[int], float], last_epoch: int = -1):
        self.scheduler_function = _check_function(scheduler_function, "scheduler_function")
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return float(self.scheduler_function(epoch))


__all__ = [
    "ExponentialGradClip", "ExponentialNoise", "LambdaGradClip", "LambdaNoise", "StepGradClip", "StepNoise",
    "_GradClipScheduler", "_NoiseScheduler",
]
