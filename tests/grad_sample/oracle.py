"""The batch-of-one oracle in every mode: per-sample gradients (hooks, functorch), or per-sample
norms and clipped sums (bk, ghost, ew), against each sample's gradient computed on the sample alone."""

from __future__ import annotations

import torch

from dptorch import DPLoss
from dptorch.clipping.factors import clip_factors
from dptorch.data import drawn
from dptorch.grad_sample import GradSampleHooks
from dptorch.optim import DPOptimizer, capture_step
from tests.helpers import call


def sample(inputs, dims, i):
    """Sample ``i`` of a batch as a batch of one; ``dims`` gives each input's batch dim (None: shared)."""
    pick = lambda t, d: t if d is None else t.narrow(d, i, 1)  # noqa: E731
    if isinstance(inputs, dict):
        return {k: pick(v, dims[k]) for k, v in inputs.items()}
    return tuple(pick(t, d) for t, d in zip(inputs, dims))


def oracle(model, inputs, dims, loss_fn, n):
    """Each sample's gradient, computed on the sample alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = {p: [] for p in params}
    for i in range(n):
        model.zero_grad(set_to_none=True)
        loss_fn(call(model, sample(inputs, dims, i))).sum().backward()
        for p in params:
            rows[p].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {p: torch.stack(r) for p, r in rows.items()}


def assert_exact(model, inputs, dims, loss_fn, mode, n, batch_first=True, draw=None, compile_model=None):
    """Per-sample gradients (hooks, functorch), or per-sample norms and clipped sums (bk, ghost),
    equal the oracle's. ``draw``: ``(tensors, make)``, the batch-first tensors a DP loader hands out
    and how the loop makes ``inputs`` from them (the draw's watch follows it). ``compile_model``: model ->
    callable, applied after the controller attached (``torch.compile`` after ``make_private(..., wrap_model=False)``);
    the private step calls what it returns."""
    want = oracle(model, inputs, dims, loss_fn, n)
    names = {p: name for name, p in model.named_parameters()}
    hooks = GradSampleHooks(model, grad_sample_mode=mode, batch_first=batch_first, loss_reduction="sum")
    try:
        if draw is not None:
            drawn.hand_out(list(draw[0]))
            inputs = draw[1](*draw[0])
        output = call(model if compile_model is None else compile_model(model), inputs)
        loss = DPLoss(loss_fn, hooks)(output) if mode == "ghost" else loss_fn(output).sum()
        loss.backward()
        scale = max(float(g.abs().max()) for g in want.values())
        close = dict(rtol=1e-4, atol=1e-5 * scale + 1e-7)
        if mode in ("hooks", "functorch"):
            got = hooks.grad_samples
            for p, g in want.items():
                torch.testing.assert_close(got[p], g, **close, msg=lambda m: f"{mode} {names[p]}: {m}")
            return
        norms = hooks.per_sample_norms()
        factor = torch.rand(n, generator=torch.Generator().manual_seed(n))
        sums = hooks.clipped_sums({p: factor for p in want})
        for p, g in want.items():
            torch.testing.assert_close(norms[p], g.flatten(1).norm(dim=1), **close, msg=lambda m: f"{mode} norm {names[p]}: {m}")
            torch.testing.assert_close(sums[p], torch.einsum("i,i...->...", factor, g), **close,
                                       msg=lambda m: f"{mode} clipped sum {names[p]}: {m}")
    finally:
        hooks.cleanup()
        model.zero_grad(set_to_none=True)




def assert_captured_exact(model, inputs, loss_fn, mode, n, bound=0.05):
    """A captured step (``capture_step``, the graph replayed uncompiled) on ``inputs``, handed out as a DP loader's
    batch (every tensor batched along dim 0): its per-sample norms and clipped sums equal the oracle's."""
    want = oracle(model, inputs, {key: 0 for key in inputs}, loss_fn, n)
    names = {p: name for name, p in model.named_parameters()}
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    try:
        optimizer = DPOptimizer(torch.optim.SGD(list(want), lr=0.1), hooks=hooks, noise_multiplier=0.0,
                                max_grad_norm=bound, loss_reduction="sum", clipping_stats="raw")
        drawn.hand_out(list(inputs.values()))
        capture_step(optimizer, lambda batch: loss_fn(call(model, batch)).sum(), compile=False)(inputs)
        norms = optimizer._raw_norms[0]
        scale = max(float(g.abs().max()) for g in want.values())
        close = dict(rtol=1e-4, atol=1e-5 * scale + 1e-7)
        torch.testing.assert_close(norms, torch.stack([g.flatten(1).norm(dim=1) for g in want.values()]).norm(dim=0)
                                   .double(), rtol=1e-4, atol=1e-7)
        factor = clip_factors(norms, bound)
        for p, g in want.items():
            torch.testing.assert_close(optimizer._summed[p], torch.einsum("i,i...->...", factor, g), **close,
                                       msg=lambda m: f"captured {mode} clipped sum {names[p]}: {m}")
    finally:
        hooks.cleanup()
        model.zero_grad(set_to_none=True)
