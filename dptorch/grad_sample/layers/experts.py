"""Mixture-of-experts expert banks (transformers' ``MixtralExperts``, ``Qwen2MoeExperts``,
``OlmoeExperts``, ...): per-sample gradients, norms and clipped sums of their 3-D weights.

The bank holds ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)`` and is called on
tokens ``x`` ``(N, H)`` with the router's choice ``top_k_index`` ``(N, k)`` and weights
``top_k_weights`` ``(N, k)``: token ``t`` sent to expert ``e`` with weight ``w`` adds
``w * down_proj[e] @ gate(gate_up_proj[e] @ x_t)`` to its output, ``gate(u) = act(u_1) * u_2``
(the halves of ``u``). Every (token, slot) pair is linear in its expert's weights, so sample
``b``'s gradient of expert ``e`` is a sum over its pairs routed to ``e``::

    down_proj[e]:    sum_p (w_p g_p) (x) a_p          a_p  = gate(u_p),   u_p = gate_up_proj[e] x_p
    gate_up_proj[e]: sum_p du_p (x) x_p               du_p = vjp(gate, u_p)(w_p down_proj[e]^T g_p)

with ``g`` the output gradient. The factors are recomputed per expert from the call's inputs (one
forward's worth of work), in float64 (float32 on the split route of ``exact_products``), and each expert's block is then a linear weight's
gradient over that sample's pairs, padded per sample (``linear.linear_weight_norms_sq``: ghost or
instantiated, certified). The bank works token by token, so its norm sampler is token-wise.

The class is recognised by its layout (``looks_like_experts``), never imported from transformers,
and the rule is checked against each sample's own autograd gradient once per instance and
experts implementation ("eager", "grouped_mm", "batched_mm" compute the same function) before use.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.norms.certified import gamma, magnitudes
from dptorch.grad_sample.norms.exact_products import products_route
from dptorch.grad_sample.layers.linear import linear_weight_norms_sq, linear_weight_sum
from dptorch.grad_sample.norms.linear_forms import at_least_float32_dtype, flatten_middle_dims
from dptorch.grad_sample.layers.registry import register_duck_grad_sampler, register_norm_sampler

Tensors = Tuple[torch.Tensor, ...]
_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
          "has_post_expert_norm": False, "_is_expert_parallel": False}
_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")


def looks_like_experts(module: nn.Module) -> bool:
    """An expert bank laid out as transformers' gated, concatenated, untransposed, bias-free experts.

    Its direct parameters are exactly ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``,
    ``num_experts == E``, its ``forward(hidden_states, top_k_index, top_k_weights)``, its gate
    transformers' default, its children (the activation) hold no parameters, and it runs one of the
    experts implementations above.
    """
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"}:
        return False
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, two_inner, hidden = gate_up.shape
    if tuple(down.shape) != (experts, hidden, two_inner // 2) or two_inner % 2 or getattr(module, "num_experts", None) != experts:
        return False
    if any(getattr(module, name, None) is not value for name, value in _FLAGS.items()):
        return False
    if getattr(getattr(module, "config", None), "_experts_implementation", None) not in _IMPLEMENTATIONS:
        return False
    gate = getattr(getattr(module, "_apply_gate", None), "__func__", None)
    if getattr(gate, "__name__", None) != "_default_apply_gate" or not callable(getattr(module, "act_fn", None)):
        return False  # the default gate, act(u_1) * u_2, whose Jacobian experts_norms_sq bounds
    if any(True for child in module.children() for _ in child.parameters()):
        return False
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names[:3] == ["hidden_states", "top_k_index", "top_k_weights"]


# ----------------------------------------------------------------------------- the factors


class ExpertFactors(NamedTuple):
    """One expert's factors for the pairs routed to it, padded per sample: ``(B, n, F)``, zero rows
    past each sample's own pairs. ``gate_up_proj[e]``'s per-sample gradient is
    ``du^T x``, ``down_proj[e]``'s ``wg^T a``."""

    expert: int
    x: torch.Tensor  # (B, n, H)
    du: torch.Tensor  # (B, n, 2I)
    wg: torch.Tensor  # (B, n, H): routing weight times output gradient
    a: torch.Tensor  # (B, n, I): the gated activation
    du_bound: Optional[torch.Tensor] = None  # (B, n, 2I): |vjp(gate)(|wg| |down_proj[e]|)|, see experts_norms_sq


def _pairs(activations: Tensors, backprops: torch.Tensor):
    """The call's (token, slot) pairs: ``(B, P, H)`` inputs and output gradients, ``(B, P)`` experts
    and weights (``P`` = tokens per sample times ``k``)."""
    x, index, weights = activations[:3]
    x = flatten_middle_dims(x)
    g = flatten_middle_dims(backprops)
    k = index.shape[-1]
    index = index.reshape(x.shape[0], x.shape[1] * k)  # explicit sizes: an empty batch has no -1
    weights = weights.reshape(x.shape[0], x.shape[1] * k)
    return x.repeat_interleave(k, dim=1), g.repeat_interleave(k, dim=1), index, weights


def _padded(values: torch.Tensor, rows: torch.Tensor, ranks: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    out = values.new_zeros(batch, width, values.shape[-1])
    out[rows, ranks] = values
    return out


def expert_factors(module: nn.Module, activations: Tensors, backprops: torch.Tensor,
                   dtype: torch.dtype, bounds: bool = False) -> Iterator[ExpertFactors]:
    """Each expert's factors (``ExpertFactors``), recomputed in ``dtype`` from the call's inputs;
    experts no pair was routed to are skipped. ``backprops`` may carry per-sample clip factors:
    every factor but ``x`` and ``a`` is linear in it. ``bounds``: also ``du_bound``."""
    x, g, index, weights = _pairs(activations, backprops)
    batch = x.shape[0]
    gate_up = module.gate_up_proj.detach().to(dtype)
    down = module.down_proj.detach().to(dtype)
    apply_gate = module._apply_gate
    for e in torch.unique(index).tolist():
        if not 0 <= e < gate_up.shape[0]:
            continue  # a slot routed to no local expert (a sentinel) adds nothing
        rows, cols = (index == e).nonzero(as_tuple=True)  # row-major: sorted by sample
        counts = torch.bincount(rows, minlength=batch)
        starts = torch.cumsum(counts, 0) - counts
        ranks = torch.arange(rows.shape[0], device=rows.device) - starts[rows]
        width = int(counts.max())
        xs = x[rows, cols].to(dtype)
        wg = g[rows, cols].to(dtype) * weights[rows, cols].to(dtype).unsqueeze(-1)
        u = xs @ gate_up[e].t()
        a, pullback = torch.func.vjp(apply_gate, u)
        (du,) = pullback(wg @ down[e])
        pad = lambda t: _padded(t, rows, ranks, batch, width)  # noqa: E731
        # each entry of du is one coefficient of the gate's Jacobian times one entry of its cotangent,
        # so for a non-negative cotangent |vjp(v)| is |J|^T v
        bound = pad(pullback(wg.abs() @ down[e].abs())[0].abs()) if bounds else None
        yield ExpertFactors(e, pad(xs), pad(du), pad(wg), pad(a), bound)


def _recompute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the factors are recomputed in: float64 where certified products take the float64 route,
    else float32 (no float64 matmul on an accelerator; ``_recompute_slack`` bounds either)."""
    return torch.float64 if products_route(device) == "float64" else torch.float32


def _factor_dtype(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> torch.dtype:
    """The dtype the clipped sum is formed in: float32 at least (the model's wider dtype if any)."""
    dtype = torch.promote_types(activations[0].dtype, backprops.dtype)
    return at_least_float32_dtype(torch.promote_types(dtype, module.gate_up_proj.dtype))


def _wanted(module: nn.Module) -> Tuple[Optional[nn.Parameter], Optional[nn.Parameter]]:
    gate_up, down = module.gate_up_proj, module.down_proj
    return (gate_up if gate_up.requires_grad else None), (down if down.requires_grad else None)


# ----------------------------------------------------------------------------- grad sampler, norms, clipped sum


def experts_grad_sampler(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients ``(B, E, 2I, H)`` and ``(B, E, H, I)``: one batched matmul per expert."""
    gate_up, down = _wanted(module)
    if gate_up is None and down is None:
        return {}
    dtype = _factor_dtype(module, activations, backprops)
    batch = activations[0].shape[0]
    grads = {p: torch.zeros(batch, *p.shape, dtype=dtype, device=p.device) for p in (gate_up, down) if p is not None}
    for f in expert_factors(module, activations, backprops, _recompute_dtype(backprops.device)):
        if gate_up is not None:
            grads[gate_up][:, f.expert] = torch.bmm(f.du.transpose(1, 2), f.x).to(dtype)
        if down is not None:
            grads[down][:, f.expert] = torch.bmm(f.wg.transpose(1, 2), f.a).to(dtype)
    return {p: g.to(p.dtype) for p, g in grads.items()}


def experts_norms_sq(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Certified per-sample squared norms: each expert's block is a linear weight's gradient over the
    sample's pairs (``linear_weight_norms_sq``, which bounds the clipped sum's matmul), widened by what
    recomputing the factors from scaled output gradients can change (``_recompute_slack``); the
    blocks' bounds are summed (rounded up)."""
    gate_up, down = _wanted(module)
    batch = activations[0].shape[0]
    wide = _recompute_dtype(backprops.device)
    dtype = _factor_dtype(module, activations, backprops)
    hidden = module.gate_up_proj.shape[2]
    norms = {p: torch.zeros(batch, dtype=wide, device=backprops.device) for p in (gate_up, down) if p is not None}
    for f in expert_factors(module, activations, backprops, wide, bounds=gate_up is not None):
        # the factors the clipped sum multiplies, in its dtype
        if gate_up is not None:
            x, du = f.x.to(dtype), f.du.to(dtype)
            slack = _recompute_slack(x, du, dtype, wide, hidden, f.du_bound)
            norms[gate_up] += (linear_weight_norms_sq(x, du).sqrt() + slack).square()
        if down is not None:
            a, wg = f.a.to(dtype), f.wg.to(dtype)
            norms[down] += (linear_weight_norms_sq(a, wg).sqrt() + _recompute_slack(a, wg, dtype, wide)).square()
    experts = module.gate_up_proj.shape[0]
    return {p: n * (1 + gamma(2 * experts + 8, wide)) for p, n in norms.items()}


def _recompute_slack(right: torch.Tensor, left: torch.Tensor, dtype: torch.dtype, wide: torch.dtype,
                     hidden: int = 0, bound: Optional[torch.Tensor] = None) -> torch.Tensor:
    """How far the clipped sum's factor ``left`` (recomputed from ``c_i g_i``) may be from ``c_i`` times
    the norms' (from ``g_i``), as a norm per sample: two casts to ``dtype`` of each entry
    (relative), and, for ``du``, the rounding of ``c_i g_i`` and of the two wide recomputations of
    ``down_proj[e]^T (w g)``, bounded by ``bound`` (``du_bound``) entrywise, not by ``|du|``."""
    slack = gamma(2, dtype) * magnitudes(left, right)
    if bound is not None:
        slack = slack + (2 * gamma(hidden + 64, wide) + gamma(2, dtype)) * magnitudes(bound, right)
    return slack.to(wide)


def experts_clipped_sum(module: nn.Module, activations: Tensors, scaled_backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """The bank's batch gradient from clip-factor-scaled output gradients: per expert, one matmul
    over all its pairs (``linear_weight_sum``)."""
    gate_up, down = _wanted(module)
    dtype = _factor_dtype(module, activations, scaled_backprops)
    sums = {p: torch.zeros(p.shape, dtype=dtype, device=p.device) for p in (gate_up, down) if p is not None}
    for f in expert_factors(module, activations, scaled_backprops, _recompute_dtype(scaled_backprops.device)):
        if gate_up is not None:
            sums[gate_up][f.expert] = linear_weight_sum(f.x.to(dtype), f.du.to(dtype))
        if down is not None:
            sums[down][f.expert] = linear_weight_sum(f.a.to(dtype), f.wg.to(dtype))
    return sums


# ----------------------------------------------------------------------------- check and registration


def experts_probe(module: nn.Module, generator: torch.Generator, tokens: int = 3) -> Tensors:
    """Two samples of ``tokens`` tokens, each routed to ``k = min(2, E)`` distinct experts with random weights."""
    experts, _, hidden = module.gate_up_proj.shape
    k = min(2, experts)
    x = torch.randn(2, tokens, hidden, generator=generator) * 2
    index = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(2 * tokens)]).view(2, tokens, k)
    weights = torch.rand(2, tokens, k, generator=generator)
    return x, index, weights


def _small_copy(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """A shallow copy with small random float32 weights (at most 3 experts of width 8, inner 8: sizes a
    multiple of 16 bytes, as grouped_mm needs): the check is of the class's forward, not of this
    instance's size. ``module`` is untouched."""
    experts = min(module.gate_up_proj.shape[0], 3)
    small = copy.copy(module)
    small._parameters = {
        "gate_up_proj": nn.Parameter(torch.randn(experts, 16, 8, generator=generator)),
        "down_proj": nn.Parameter(torch.randn(experts, 8, 8, generator=generator)),
    }
    small.num_experts, small.hidden_dim, small.intermediate_dim = experts, 8, 8
    small.training = True
    return small


def matches_batch_of_one(module: nn.Module) -> bool:
    """Whether the rule reproduces, on a small copy, each sample's gradient of the bank's own forward
    run on that sample alone (per-sample gradients, squared norms, clipped sum). Any error: False."""
    try:
        generator = torch.Generator().manual_seed(0)
        small = _small_copy(module, generator)
        inputs = experts_probe(small, generator)
        backprops = torch.randn(*inputs[0].shape, generator=generator)
        params = list(small._parameters.values())
        want = []
        with torch.enable_grad():
            for i in range(2):
                out = small.forward(inputs[0][i], inputs[1][i], inputs[2][i])
                want.append(torch.autograd.grad((out * backprops[i]).sum(), params, allow_unused=True))
        want = {p: torch.stack([torch.zeros_like(p) if w[j] is None else w[j] for w in want]) for j, p in enumerate(params)}
        got = experts_grad_sampler(small, inputs, backprops)
        squared = experts_norms_sq(small, inputs, backprops)
        factors = torch.rand(2, generator=generator) + 0.5
        sums = experts_clipped_sum(small, inputs, backprops * factors.view(2, 1, 1))
        close = lambda x, y: torch.allclose(x.double(), y.double(), rtol=1e-4, atol=1e-5 * float(y.abs().max()))  # noqa: E731
        return all(
            close(got[p], w) and close(squared[p], w.flatten(1).pow(2).sum(1))
            and close(sums[p], torch.einsum("i,i...->...", factors, w)) for p, w in want.items()
        )
    except Exception:
        return False


_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, Dict[object, bool]]" = weakref.WeakKeyDictionary()


def verify_experts(module: nn.Module) -> bool:
    """``matches_batch_of_one``, once per instance and experts implementation (it can be switched)."""
    key = getattr(getattr(module, "config", None), "_experts_implementation", None)
    verdicts = _VERDICTS.setdefault(module, {})
    if key not in verdicts:
        verdicts[key] = matches_batch_of_one(module)
    return verdicts[key]


register_duck_grad_sampler(looks_like_experts, verify=verify_experts)(experts_grad_sampler)
# find_norm_sampler hands the norm sampler only to modules the grad sampler's check passed
register_norm_sampler(predicate=looks_like_experts, clipped_sum=experts_clipped_sum, token_wise=True)(experts_norms_sq)
