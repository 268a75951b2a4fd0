"""The oracle of one private step: refused, or exact against the float64 batch-of-one reference.

A step is run as a user runs it: ``make_private`` (noise 0, ``loss_reduction="sum"``, SGD with
lr 1), the loader's batch, ``loss_fn(model, *batch).backward()``, ``optimizer.step()``. Its
result is the noiseless clipped sum the optimizer wrote into ``p.grad``.

The reference is built from each sample's own loss term computed on that sample alone (a batch
of one) in float64: ``sum_i min(1, C / |g_i|) g_i``. :func:`verdict` accepts a step that is
refused (a ``PerSampleGradientError`` or ``UnsupportedModuleError`` with the parameters
untouched), or whose clipped sums, for the batch, the batch with sample 0 replaced and the batch
with sample 0 removed, all equal their references; it also measures the moves (replace-one,
bound 2C; add/remove, bound C). Where the computation couples samples, the batch-of-one
reference differs from what the batch computes, so refusing is the only way to pass; where the
coupling never reaches a gradient, the exact answer is private and passes too.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dptorch import PrivacyEngine
from dptorch.data import DPDataLoader
from dptorch.grad_sample.errors import PerSampleGradientError, UnsupportedModuleError
from dptorch.grad_sample.tracking import unseen
from dptorch.optim import capture_step

REFUSED = (PerSampleGradientError, UnsupportedModuleError)
EW_REFUSED = REFUSED + (RuntimeError,)  # torch's expanded weights refuse a direct weight read themselves
RTOL = 1e-4
LossFn = Callable[..., torch.Tensor]  # loss_fn(model, *batch) -> the scalar the step back-propagates


@dataclass
class Step:
    """One private step: refused (the error), or the clipped sum it wrote (by parameter name), or
    another exception (neither a refusal nor a result)."""

    refused: Optional[str] = None
    sums: Optional[dict] = None
    error: Optional[str] = None


def refusals(mode: str) -> tuple:
    return EW_REFUSED if mode == "ew" else REFUSED


def private_step(model: nn.Module, batch: tuple, loss_fn: LossFn, mode: str, max_grad_norm: float,
                 compile_model: Optional[Callable[[nn.Module], Callable]] = None, captured: bool = False) -> Step:
    """One step of a copy of ``model`` through ``make_private`` (noise 0, SGD lr 1) on ``batch``; with
    ``compile_model`` (model -> callable), ``make_private(..., wrap_model=False)`` and the loss given what
    ``compile_model`` makes of the model (``torch.compile`` after attaching, as a user compiles); with
    ``captured``, ``wrap_model=False`` and the forward and backward a ``capture_step`` (its graph replayed
    uncompiled)."""
    model = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loader = DPDataLoader(TensorDataset(*batch), sample_rate=1.0, steps=1)
    engine, depth = PrivacyEngine(), torch._C._len_torch_function_stack()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # noise_multiplier=0: "not private", on purpose
            private, optimizer, loader = engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
                noise_multiplier=0.0, max_grad_norm=max_grad_norm, loss_reduction="sum", grad_sample_mode=mode,
                wrap_model=compile_model is None and not captured)
            if compile_model is not None:
                private = compile_model(model)
            step = capture_step(optimizer, lambda *b: loss_fn(model, *b), compile=False) if captured else None
            for drawn in loader:
                assert all(torch.equal(d, b) for d, b in zip(drawn, batch)), "the loader must hand out the batch"
                if captured:
                    step(*drawn)
                else:
                    loss_fn(private, *drawn).backward()
                optimizer.step()
    except refusals(mode) as e:
        changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
        if changed:
            return Step(error=f"refused after parameters changed ({', '.join(changed)}): {type(e).__name__}: {e}")
        return Step(refused=f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - a crash is a verdict too (neither refused nor a result)
        return Step(error=f"{type(e).__name__}: {e}")
    finally:
        # Detached as a careful user would: a refused step's tracker otherwise stays on torch's mode
        # stack and would judge the next steps too.
        engine.detach()
        left = torch._C._len_torch_function_stack() - depth
        while torch._C._len_torch_function_stack() > depth:
            torch._C._pop_torch_function_stack()
        if left:
            return Step(error=f"the step left {left} torch function mode(s) on the stack after engine.detach()")
        if unseen._on_stack():
            unseen.off()
            return Step(error="the step left the guard of unseen operations on the dispatch stack after engine.detach()")
    return Step(sums={n: (torch.zeros_like(p) if p.grad is None else p.grad).detach().double()
                      for n, p in model.named_parameters()})


def unit_grads_alone(model: nn.Module, batch: tuple, loss_fn: LossFn) -> Optional[list]:
    """Per sample, in float64, the gradient of its own loss term computed on it alone (a batch of
    one); None where that term cannot be computed alone (batch norm of a single value)."""
    ref = copy.deepcopy(model).double()
    grads = []
    for i in range(len(batch[0])):
        sample = tuple(t[i : i + 1].double() if t.is_floating_point() else t[i : i + 1] for t in batch)
        ref.zero_grad(set_to_none=True)
        try:
            loss_fn(ref, *sample).backward()
        except (RuntimeError, ValueError):
            return None
        grads.append({n: (torch.zeros_like(p) if p.grad is None else p.grad).detach().clone()
                      for n, p in ref.named_parameters()})
    return grads


def clipped_sum_of(units: list, like: dict, max_grad_norm: float) -> dict:
    """``sum_i min(1, C / |g_i|) g_i`` in float64; a unit whose gradient is not finite adds 0."""
    total = {n: torch.zeros_like(t) for n, t in like.items()}
    for g in units:
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g.values()))
        if not math.isfinite(norm):
            continue
        factor = min(1.0, max_grad_norm / norm) if norm > 0 else 1.0
        for n, t in g.items():
            total[n] += factor * t
    return total


def mismatch(got: dict, want: dict, max_grad_norm: float) -> float:
    """Largest ``|got - want|`` over the allowed ``atol + rtol |want|`` (<= 1: equal to float tolerance).

    ``atol`` is ``rtol`` times the largest reference entry, and at least ``1e-5 C``: float32
    rounding of O(1) activations is ~1e-7, far below it, and a leak is far above."""
    scale = max(float(t.abs().max()) for t in want.values())
    atol = 1e-5 * max_grad_norm + RTOL * scale
    return max(float(((got[n] - want[n]).abs() / (atol + RTOL * want[n].abs())).max()) for n in want)


def distance(a: dict, b: dict) -> float:
    return float(sum((a[n] - b[n]).pow(2).sum() for n in a) ** 0.5)


def verdict(model: nn.Module, batch: tuple, loss_fn: LossFn, mode: str, max_grad_norm: float, *,
            replacement: Optional[tuple] = None, compile_model: Optional[Callable[[nn.Module], Callable]] = None,
            captured: bool = False) -> dict:
    """The verdict on one step: ``outcome`` (refused, exact, inexact, error), ``message`` (a
    refusal's), the moves over their bounds, and ``problems`` (empty: the oracle holds).

    The neighbours: ``batch`` without sample 0, and with sample 0 replaced by sample 0 of
    ``replacement`` (when given). ``compile_model``: every private step calls the model compiled so; ``captured``:
    every private step is a captured one (``private_step``)."""
    plain = copy.deepcopy(model)
    loss_fn(plain, *batch).backward()  # the computation itself runs in plain torch
    result = {"mode": mode, "problems": []}
    base = private_step(model, batch, loss_fn, mode, max_grad_norm, compile_model, captured)
    if base.refused is not None:
        return {**result, "outcome": "refused", "message": base.refused[:300]}
    if base.error is not None:
        return {**result, "outcome": "error", "message": base.error[:300], "problems": [f"crashed: {base.error[:300]}"]}
    units = unit_grads_alone(model, batch, loss_fn)
    cases = {"batch": (batch, units), "removed": (tuple(b[1:] for b in batch), None if units is None else units[1:])}
    if replacement is not None:
        fresh = unit_grads_alone(model, tuple(r[:1] for r in replacement), loss_fn)
        cases["replaced"] = (tuple(torch.cat([r[:1], b[1:]]) for r, b in zip(replacement, batch)),
                             None if units is None or fresh is None else fresh + units[1:])
    runs = {"batch": base}
    worst = 0.0
    for name, (data, want) in cases.items():
        if name not in runs:
            runs[name] = private_step(model, data, loss_fn, mode, max_grad_norm, compile_model, captured)
        step = runs[name]
        if step.error is not None:
            result["problems"].append(f"{name}: crashed: {step.error[:300]}")
        elif step.sums is not None and want is None:
            result["problems"].append(f"{name}: not refused, yet its loss cannot be computed per sample alone")
        elif step.sums is not None:
            err = mismatch(step.sums, clipped_sum_of(want, step.sums, max_grad_norm), max_grad_norm)
            worst = max(worst, err)
            if err > 1:
                result["problems"].append(f"{name}: clipped sum differs from the batch-of-one reference "
                                          f"({err:.3g} x tolerance)")
    for name, bound in (("replaced", 2 * max_grad_norm), ("removed", max_grad_norm)):
        if name in runs and runs[name].sums is not None:
            moved = distance(base.sums, runs[name].sums)
            result[f"{name}_move_over_bound"] = moved / bound
            if moved > bound * (1 + 1e-5):
                result["problems"].append(f"{name}: moved {moved:.4g} (bound {bound:g}) = {moved / bound:.3g} x bound")
    return {**result, "outcome": "inexact" if result["problems"] else "exact", "mismatch": worst}
