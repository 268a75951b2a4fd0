"""fp16 loss scaling without data-dependent skips: :class:`DPGradScaler` and its schedule.

torch's ``GradScaler`` skips the optimizer step, and halves the scale, whenever any gradient
overflowed: whether one sample's gradient overflowed then decides whether the whole step
happens and what every later step's scale is, a data-dependent event no accountant covers.
``DPGradScaler`` keeps torch's calls (``scaler.scale(loss).backward(); scaler.step(optimizer);
scaler.update()``) and changes what they decide:

* the scale follows a schedule fixed before training (:func:`loss_scale_at`): constant, or
  multiplied by ``growth_factor`` every ``growth_interval`` steps up to ``max_scale``, a function of
  the number of real optimizer steps only; ``update()`` advances it and never looks at a gradient;
* ``scale(loss)`` tells the bound :class:`~dptorch.optim.DPOptimizer` that this backward pass's
  gradients are ``S`` times too large: the optimizer divides each unit's norm by ``S`` before
  clipping and the clip factor by ``S`` (:func:`unscale_norms`, :func:`unscale_factors`), so the
  clipped sum, the noise (float32) and ``p.grad`` (the float32 parameters' dtype under autocast)
  are in true units. A unit whose gradient overflowed (inf or NaN) is dropped by the rule every
  non-finite unit follows (``dptorch.clipping.factors.drop_nonfinite``): it contributes zero,
  the others are unaffected;
* ``step(optimizer)`` always steps (a virtual step stays one: it neither steps nor advances the schedule).

The scale and the growth factor are powers of two, so scaling and unscaling are exact in
float16 and float32 (outside the subnormal range): the norms the clip factors are formed from,
and their rounding bounds (``dptorch.grad_sample.norms.certified``), are those of the unscaled gradient.

The cost of a fixed schedule is that an overflow is not recovered from: a unit whose scaled
gradient exceeds float16's 65504 anywhere in the backward pass contributes nothing to that step.
Choose the scale so that ``S`` times the largest backward value stays below that (docs/privacy.md,
"fp16 loss scaling"); ``clipping_stats="private"`` releases the noised number of dropped units
per step, covered by epsilon, to check it.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional, Union

import torch
from torch.amp.grad_scaler import GradScaler, OptState

#: Above this no schedule grows (float16's largest value is 65504: a scale of 2^24 leaves room for
#: backward values below 2^-8 only).
DEFAULT_MAX_SCALE = 2.0**24


def _is_power_of_two(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0 \
        and math.frexp(value)[0] == 0.5


def loss_scale_at(
    steps: int, init_scale: float, growth_factor: float = 2.0, growth_interval: Optional[int] = None,
    max_scale: Optional[float] = None,
) -> float:
    """The loss scale after ``steps`` optimizer steps: ``min(init * growth_factor^(steps // interval), max)``,
    or ``init_scale`` for every step when ``growth_interval`` is None. A function of the step count only."""
    if growth_interval is None:
        return float(init_scale)
    cap = max(DEFAULT_MAX_SCALE, init_scale) if max_scale is None else max_scale
    growths = steps // growth_interval
    if growths * math.log2(growth_factor) >= math.log2(cap / init_scale):
        return float(cap)
    return float(init_scale * growth_factor**growths)


def unscale_norms(norms: Dict[Any, torch.Tensor], scale: float) -> Dict[Any, torch.Tensor]:
    """Per-unit norms of a backward pass whose loss was multiplied by ``scale``, in true units (exact for a
    power of two; inf and NaN stay what they are)."""
    return norms if scale == 1.0 else {key: n / scale for key, n in norms.items()}


def unscale_factors(factors: Dict[Any, torch.Tensor], scale: float) -> Dict[Any, torch.Tensor]:
    """Clip factors formed from unscaled norms, divided by ``scale``: applied to the scaled rows they give the
    clipped sum in true units, each unit's contribution of norm ``min(||g_i||, C)`` whatever ``scale`` is."""
    return factors if scale == 1.0 else {key: f / scale for key, f in factors.items()}


def check_schedule(init_scale: Any, growth_factor: Any = 2.0, growth_interval: Any = None, max_scale: Any = None) -> None:
    """Refuse a loss-scale schedule :class:`DPGradScaler` cannot keep exact (powers of two) or data-independent."""
    for name, value in (("init_scale", init_scale), ("growth_factor", growth_factor)):
        if not _is_power_of_two(value):
            raise ValueError(f"{name} must be a power of two (scaling and unscaling are then exact), got {value!r}")
    if growth_interval is not None:
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a whole number of steps >= 1 or None, got {growth_interval!r}")
        if growth_factor < 2:
            raise ValueError(f"growth_factor must be >= 2 for a growing schedule, got {growth_factor!r}")
    if max_scale is not None and not (_is_power_of_two(max_scale) and max_scale >= init_scale):
        raise ValueError(f"max_scale must be a power of two >= init_scale={init_scale}, got {max_scale!r}")


class DPGradScaler(GradScaler):
    """A ``torch.amp.GradScaler`` for a :class:`~dptorch.optim.DPOptimizer`: fixed schedule, no skipped step.

    ``DPGradScaler(optimizer, init_scale=2.**16)`` keeps the scale at ``init_scale``; with
    ``growth_interval=k`` it is multiplied by ``growth_factor`` every k steps up to ``max_scale``
    (default 2^24). ``init_scale``, ``growth_factor`` and ``max_scale`` are powers of two. The
    optimizer's parameters must be float32 (autocast keeps them so): the noised gradient is then
    written in float32 and the inner optimizer updates float32 master weights.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        growth_interval: Optional[int] = None,
        max_scale: Optional[float] = None,
        device: Optional[str] = None,
        enabled: bool = True,
    ) -> None:
        dp = _dp_optimizer(optimizer)
        if dp is None:
            raise TypeError(
                f"DPGradScaler scales the loss for a DPOptimizer (which unscales each unit's gradient before clipping); "
                f"got a {type(optimizer).__name__}. Pass the optimizer make_private returned"
            )
        check_schedule(init_scale, growth_factor, growth_interval, max_scale)
        params = dp.params
        low = [dp.hooks.parameter_name(p) for p in params if p.dtype in (torch.float16, torch.bfloat16)]
        if low:
            raise ValueError(
                f"DPGradScaler: the parameters {', '.join(low[:5])} are 16-bit, so the noised gradient and the update "
                "would be rounded to 16 bits. Keep the parameters in float32 (no model.half()) and run the forward "
                "under torch.autocast(device_type, dtype=torch.float16), which computes in float16 from them"
            )
        if growth_interval is not None and max_scale is None:
            max_scale = max(DEFAULT_MAX_SCALE, float(init_scale))
        device = device or (params[0].device.type if params else "cpu")
        super().__init__(device=device, init_scale=float(init_scale), growth_factor=max(float(growth_factor), 2.0),
                         growth_interval=growth_interval or 2**31 - 1, enabled=enabled)
        self.optimizer = dp
        self.schedule = {"init_scale": float(init_scale), "growth_factor": float(growth_factor),
                         "growth_interval": growth_interval, "max_scale": None if max_scale is None else float(max_scale)}
        self._steps = 0  # real (privatised) optimizer steps: the schedule's clock
        self._stepped = False  # a real step was taken since the last update()
        self._pending = False  # a loss was scaled since the last backward round the optimizer consumed
        if self._enabled:
            dp.loss_scaler = self

    # ------------------------------------------------------------------ the schedule

    @property
    def current_scale(self) -> float:
        """The scale of this step (a host float: the schedule needs no device sync)."""
        return loss_scale_at(self._steps, **self.schedule) if self._enabled else 1.0

    def round_scale(self) -> float:
        """The factor the backward round that just ended was scaled by (1 if no loss was scaled); consumed."""
        scaled, self._pending = self._pending, False
        return self.current_scale if scaled else 1.0

    def scale(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]) -> Any:
        """``outputs`` times this step's scale; the next backward round is unscaled by the DP optimizer."""
        scaled = super().scale(outputs)
        if self._enabled:
            self._pending = True
        return scaled

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to do: the DP optimizer unscales each unit's gradient before clipping, and ``p.grad`` only
        ever holds the unscaled, noised gradient (``clip_grad_norm_`` after it would clip the noise)."""
        if not self._enabled:
            return
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._record_no_inf(optimizer)
        state["stage"] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``, always: a unit that overflowed was dropped, never the step."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if _dp_optimizer(optimizer) is not self.optimizer:
            raise ValueError(
                f"DPGradScaler.step got a {type(optimizer).__name__} that is not the DPOptimizer it was built for; "
                "build one DPGradScaler per DPOptimizer"
            )
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        self._record_no_inf(optimizer)
        self._pending = False
        result = optimizer.step(*args, **kwargs)
        self._stepped = self._stepped or not self.optimizer._last_step_skipped
        state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None) -> None:
        """Advance the schedule by one step if a real step was taken since the last update, whatever the
        gradients held. A virtual step (one physical batch of a logical one: ``BatchMemoryManager``,
        ``signal_skip_step``) does not advance it: how many physical batches a Poisson draw filled is not
        released, so the scale must not depend on it, and every batch of a logical step shares one scale."""
        if not self._enabled:
            return
        if new_scale is not None:
            raise ValueError(
                "DPGradScaler's scale follows the schedule it was built with, never a value chosen during training "
                "(a scale chosen from the gradients would be a data-dependent release); set init_scale, "
                "growth_interval, growth_factor and max_scale when building it"
            )
        self._steps += int(self._stepped)
        self._stepped = self._pending = False
        self._sync_torch_scale()
        self._per_optimizer_states.clear()

    def _record_no_inf(self, optimizer: torch.optim.Optimizer) -> None:
        """What torch's scaler keeps after its inf check: here always 'no inf' (non-finite units were dropped)."""
        device = self._scale.device if self._scale is not None else torch.device(self._device)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {device: torch.zeros((), device=device)}

    def _sync_torch_scale(self) -> None:
        """torch's scale tensor (read by ``get_scale()`` and Accelerate) follows the schedule."""
        self._init_scale = self.current_scale
        if self._scale is not None:
            self._scale.fill_(self._init_scale)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """torch's entries (the current scale) plus the schedule and the steps it has advanced."""
        state = super().state_dict()
        if self._enabled:
            state["dp_schedule"] = dict(self.schedule)
            state["dp_steps"] = self._steps
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not self._enabled:
            return
        if "dp_steps" not in state_dict:
            raise ValueError(
                "this scaler state was not saved by a DPGradScaler (it has no schedule position): a torch GradScaler's "
                "scale depends on the overflows it saw; start the DPGradScaler from its schedule instead"
            )
        self.schedule = dict(state_dict["dp_schedule"])
        self._steps = int(state_dict["dp_steps"])
        self._sync_torch_scale()

    @classmethod
    def replacing(cls, scaler: GradScaler, optimizer: torch.optim.Optimizer, init_scale: Optional[float] = None,
                  growth_interval: Optional[int] = None) -> "DPGradScaler":
        """A DPGradScaler in place of torch's ``scaler`` (built by Accelerate for ``fp16=True``): ``init_scale``, or
        the scaler's initial scale rounded down to a power of two; fixed unless ``growth_interval`` is given (then
        doubling every ``growth_interval`` steps up to 2^24); none of torch's backoff."""
        if init_scale is None:
            init_scale = 2.0 ** math.floor(math.log2(float(getattr(scaler, "_init_scale", 2.0**16))))
        return cls(optimizer, init_scale=init_scale, growth_interval=growth_interval,
                   device=getattr(scaler, "_device", None), enabled=scaler.is_enabled())


def plain_scaler_error() -> str:
    """The refusal when torch's own GradScaler drives a DPOptimizer's step (named with its fix)."""
    return (
        "a torch.amp.GradScaler drove this DPOptimizer step: it multiplied the loss, so the per-sample gradients were "
        "clipped S times too large, and it would skip the step (and lower the scale) whenever one sample's gradient "
        "overflowed, a data-dependent event the accountant does not cover. Nothing was stepped or accounted. Use "
        "scaler = dptorch.optim.DPGradScaler(optimizer, init_scale=2.**16) with the same scaler.scale(loss).backward(); "
        "scaler.step(optimizer); scaler.update() calls: its scale follows a fixed schedule, each unit's gradient is "
        "unscaled before clipping, and a unit that overflowed contributes zero instead of skipping the step"
    )


def _dp_optimizer(optimizer: Any) -> Any:
    """The DPOptimizer ``optimizer`` is, or wraps through ``.optimizer`` (Accelerate's), else None (known by the
    ``loss_scaler`` slot it declares: the optimizer module imports this one, not the other way round)."""
    current, seen = optimizer, 0
    while current is not None and seen < 8:
        if isinstance(current, torch.optim.Optimizer) and hasattr(type(current), "loss_scaler"):
            return current
        current, seen = getattr(current, "optimizer", None), seen + 1
    return None
