"""The oracle harness: per-sample gradients must equal the gradients of each sample alone.

``check_per_sample_grads(model, inputs)`` runs the model once on the whole batch with the
controller attached, then once per sample (a batch of one) without it, and compares every
trainable parameter's ``grad_sample[i]`` with the batch-of-one gradient.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from dptorch.grad_sample import GradSampleHooks, GradSampleModule

LossFn = Callable[[Any], torch.Tensor]


def projection_loss(output: Any, batch_dim: int = 0) -> torch.Tensor:
    """Per-sample losses: each sample's first output tensor dotted with a fixed random tensor.

    The projection depends only on the per-sample shape, so a sample alone and the same sample
    inside a batch get the same loss.
    """
    out = next(t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point())
    per_sample_shape = out.shape[:batch_dim] + out.shape[batch_dim + 1 :]
    g = torch.Generator().manual_seed(1234)
    weights = torch.randn(per_sample_shape, generator=g, dtype=torch.float64).to(out.dtype)
    products = out * weights.unsqueeze(batch_dim)
    return products.movedim(batch_dim, 0).flatten(1).sum(dim=1)


def call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def sample_of(inputs: Any, i: int, batch_size: int, batch_dim: int = 0) -> Any:
    """Sample ``i`` of a batch as a batch of one; tensors without the batch pass unchanged."""

    def pick(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim and t.shape[batch_dim] == batch_size:
            return t.narrow(batch_dim, i, 1)
        return t

    return tree_map(pick, inputs)


def batch_size_of(inputs: Any, batch_dim: int = 0) -> int:
    return next(t.shape[batch_dim] for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor))


def reference_per_sample_grads(
    model: nn.Module, inputs: Any, loss_fn: LossFn, *, batch_dim: int = 0
) -> Dict[nn.Parameter, torch.Tensor]:
    """Gradients of each sample's own loss, one backward per sample (batch of one)."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = batch_size_of(inputs, batch_dim)
    rows: Dict[nn.Parameter, list] = {p: [] for p in params}
    for i in range(n):
        model.zero_grad(set_to_none=True)
        loss_fn(call(model, sample_of(inputs, i, n, batch_dim))).sum().backward()
        for p in params:
            rows[p].append(torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
    model.zero_grad(set_to_none=True)
    return {p: torch.stack(r) if r else p.new_zeros((0, *p.shape)) for p, r in rows.items()}


def check_per_sample_grads(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: Optional[LossFn] = None,
    loss_reduction: str = "mean",
    batch_first: bool = True,
    wrap: bool = False,
    grad_sample_mode: str = "hooks",
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Assert that the controller's per-sample gradients match the batch-of-one reference."""
    batch_dim = 0 if batch_first else 1
    loss_fn = loss_fn or (lambda out: projection_loss(out, batch_dim))
    expected = reference_per_sample_grads(model, inputs, loss_fn, batch_dim=batch_dim)
    kwargs = dict(batch_first=batch_first, loss_reduction=loss_reduction, grad_sample_mode=grad_sample_mode)
    runner = GradSampleModule(model, **kwargs) if wrap else None
    hooks = runner.hooks if wrap else GradSampleHooks(model, **kwargs)
    try:
        losses = loss_fn(call(runner or model, inputs))
        (losses.mean() if loss_reduction == "mean" else losses.sum()).backward()
        got = hooks.grad_samples
        names = {p: n for n, p in model.named_parameters()}
        for p, want in expected.items():
            assert p in got, f"no per-sample gradient for {names[p]}"
            assert got[p].shape == want.shape, f"{names[p]}: shape {tuple(got[p].shape)} != {tuple(want.shape)}"
            tol = atol + 1e-5 * float(want.abs().max()) if want.numel() else atol  # float32 summation order
            torch.testing.assert_close(got[p], want, rtol=rtol, atol=tol, msg=lambda m: f"{names[p]}: {m}")
            if want.shape[0] and grad_sample_mode not in ("ew", "bk"):  # these leave p.grad to the DP optimizer
                scale = want.shape[0] if loss_reduction == "mean" else 1
                torch.testing.assert_close(p.grad, want.sum(0) / scale, rtol=rtol, atol=tol * 10)
        assert set(got) == set(expected), "per-sample gradients for frozen parameters"
        return got
    finally:
        hooks.cleanup()
        model.zero_grad(set_to_none=True)


def snapshot(model: nn.Module) -> Dict[str, Any]:
    """Everything hooks could leave behind: each module's and parameter's dict and hook tables."""
    state: Dict[str, Any] = {}
    for name, m in model.named_modules():
        state[f"module:{name}"] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in m.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")}
    for name, p in model.named_parameters():
        state[f"param:{name}"] = (dict(p.__dict__), p._post_accumulate_grad_hooks, p._backward_hooks)
    state["state_dict_keys"] = list(model.state_dict().keys())
    return state


@pytest.fixture(autouse=True)
def single_thread():
    """One intra-op thread while a test runs (autouse where imported): tiny models on a shared 2-core
    machine, where two spinning OpenMP threads per process cost several times the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
