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
forward's worth of work) in float32 (the model's dtype if wider), and each expert's block is then a
linear weight's gradient over that sample's pairs, padded per sample (``linear.linear_weight_norms_sq``:
ghost or instantiated, certified). The bank works token by token, so its norm sampler is token-wise.

The norm pass keeps its factors for the clipped sum (``experts_kept_clipped_sum``; the layer call holds
them for its round, ``NormSampler.kept_clipped_sum``), which applies each sample's clip factor ``c_b``
to them: ``sum_p (c_b du_p) x_p^T`` and ``sum_p (c_b wg_p) a_p^T``. Every factor but ``x`` and ``a`` is
linear in ``g``, so this is the clipped sum, and it is formed from the very arrays whose norm was
certified: ``linear_weight_norms_sq`` bounds ``||sum_p du_p x_p^T||`` of those arrays, rounding included,
and the sum's own roundings (the factor's application, ``CLIP_ROUNDINGS``, and the matmul over the
sample's pairs) as for a Linear layer over the pairs. Whether those arrays are the exact gradient
does not matter to the bound (a few float32 roundings off it: the exactness tests' concern): what is
summed for a sample is within ``c_b`` times the certified norm. Recomputing the factors from the
scaled ``c_b g`` instead (``experts_clipped_sum``, where no norm pass was kept) gives arrays that differ
by rounding from those whose norm was certified.

The class is recognised by its layout (``looks_like_experts``), never imported from transformers,
and the rule is checked against each sample's own autograd gradient once per instance and
experts implementation ("eager", "grouped_mm", "batched_mm" compute the same function) before use.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Dict, Iterable, Iterator, NamedTuple, Optional, Tuple

import torch
from torch import nn

from dptorch.grad_sample.norms.certified import gamma, wide_dtype
from dptorch.grad_sample.layers.linear import common_dtype, linear_weight_norms_sq
from dptorch.grad_sample.norms.linear_forms import at_least_float32_dtype, flatten_middle_dims, run_sums
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
    """One expert's factors, one row per (token, slot) pair routed to it, each sample's pairs together and
    in sample order: over sample ``b``'s pairs, ``gate_up_proj[e]``'s gradient is ``du^T x`` and
    ``down_proj[e]``'s ``wg^T a``."""

    expert: int
    x: torch.Tensor  # (P, H)
    du: torch.Tensor  # (P, 2I)
    wg: torch.Tensor  # (P, H): routing weight times output gradient
    a: torch.Tensor  # (P, I): the gated activation
    rows: torch.Tensor  # (P,) the sample of each pair
    ranks: torch.Tensor  # (P,) its place among its sample's pairs
    batch: int
    width: int  # the most pairs of one sample

    def padded(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``(P, F)`` as ``(B, width, F)``: each sample's pairs, zero rows past them."""
        out = values.new_zeros(self.batch, self.width, values.shape[-1])
        out[self.rows, self.ranks] = values
        return out


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


def expert_factors(module: nn.Module, activations: Tensors, backprops: torch.Tensor,
                   dtype: torch.dtype) -> Iterator[ExpertFactors]:
    """Each expert's factors (``ExpertFactors``), computed in ``dtype`` from the call's inputs; experts
    no pair was routed to are skipped. ``backprops`` may carry per-sample clip factors: every factor
    but ``x`` and ``a`` is linear in it."""
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
        xs = x[rows, cols].to(dtype)
        wg = g[rows, cols].to(dtype) * weights[rows, cols].to(dtype).unsqueeze(-1)
        a, pullback = torch.func.vjp(apply_gate, xs @ gate_up[e].t())
        (du,) = pullback(wg @ down[e])
        yield ExpertFactors(e, xs, du, wg, a, rows, ranks, batch, int(counts.max()))


def _factor_dtype(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> torch.dtype:
    """The dtype the factors and the clipped sum are formed in: float32 at least (the model's wider dtype if any)."""
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
    for f in expert_factors(module, activations, backprops, dtype):
        if gate_up is not None:
            grads[gate_up][:, f.expert] = torch.bmm(f.padded(f.du).transpose(1, 2), f.padded(f.x))
        if down is not None:
            grads[down][:, f.expert] = torch.bmm(f.padded(f.wg).transpose(1, 2), f.padded(f.a))
    return {p: g.to(p.dtype) for p, g in grads.items()}


def experts_norms_sq(module: nn.Module, activations: Tensors, backprops: torch.Tensor,
                     keep: Optional[Dict[str, object]] = None) -> Dict[nn.Parameter, torch.Tensor]:
    """Certified per-sample squared norms: each expert's block is a linear weight's gradient over the
    sample's pairs (``linear_weight_norms_sq``, which bounds the clipped sum's matmul); the blocks'
    bounds are summed (rounded up). ``keep``: a dict that gets the factors, for ``experts_kept_clipped_sum``."""
    gate_up, down = _wanted(module)
    wide = wide_dtype(backprops.device)
    norms = {p: torch.zeros(activations[0].shape[0], dtype=wide, device=backprops.device) for p in (gate_up, down) if p is not None}
    dtype = _factor_dtype(module, activations, backprops)
    kept = []
    for f in expert_factors(module, activations, backprops, dtype):
        if keep is not None:
            kept.append(f)
        if gate_up is not None:
            norms[gate_up] += linear_weight_norms_sq(f.padded(f.x), f.padded(f.du))
        if down is not None:
            norms[down] += linear_weight_norms_sq(f.padded(f.a), f.padded(f.wg))
    if keep is not None:
        keep.update(factors=kept, dtype=dtype)
    experts = module.gate_up_proj.shape[0]
    return {p: n * (1 + gamma(experts + 2, wide)) for p, n in norms.items()}  # the blocks' sum, rounded up


def _summed(module: nn.Module, factors: Iterable[ExpertFactors], dtype: torch.dtype,
            scale: Optional[torch.Tensor] = None, dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
    """Per expert, ``sum_p (c_p du_p) x_p^T`` and ``sum_p (c_p wg_p) a_p^T`` over all its pairs, each sample's
    pairs first (``linear_forms.run_sums``), in ``dtype`` (the factors'), with ``c_p`` the factor ``scale`` of the pair's
    sample (None: 1); the pairs of the samples in ``dropped`` add exactly 0 (``torch.where``: their rows
    may be inf or NaN)."""
    gate_up, down = _wanted(module)
    sums = {p: torch.zeros(p.shape, dtype=dtype, device=p.device) for p in (gate_up, down) if p is not None}
    for f in factors:
        x, du, wg, a = f.x, f.du, f.wg, f.a
        if scale is not None:
            c = scale.to(device=du.device, dtype=torch.promote_types(scale.dtype, dtype))[f.rows].unsqueeze(-1)
            du, wg = du * c, wg * c
        if dropped is not None:
            gone = dropped.to(du.device)[f.rows].unsqueeze(-1)
            x, du, wg, a = (torch.where(gone, t.new_zeros(()), t) for t in (x, du, wg, a))
        # the pairs are in sample order: each sample's run of pairs is summed on its own first (``run_sums``)
        lengths = torch.bincount(f.rows, minlength=f.batch).tolist()
        if gate_up is not None:
            sums[gate_up][f.expert] = run_sums(*common_dtype(du, x), lengths)
        if down is not None:
            sums[down][f.expert] = run_sums(*common_dtype(wg, a), lengths)
    return sums


def experts_clipped_sum(module: nn.Module, activations: Tensors, scaled_backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """The bank's batch gradient from clip-factor-scaled output gradients, its factors recomputed (where
    no norm pass was kept: ``experts_kept_clipped_sum``)."""
    dtype = _factor_dtype(module, activations, scaled_backprops)
    return _summed(module, expert_factors(module, activations, scaled_backprops, dtype), dtype)


def experts_kept_clipped_sum(module: nn.Module, kept: Dict[str, object], factors: torch.Tensor,
                             dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
    """The bank's batch gradient from the factors its norm pass kept (``experts_norms_sq(keep=)``), each
    sample's factor ``factors`` ``(B,)`` applied to its pairs' ``du`` and ``wg``: the gradient whose norm was
    bounded, scaled."""
    return _summed(module, kept["factors"], kept["dtype"], factors, dropped)


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
        kept: Dict[str, object] = {}
        squared = experts_norms_sq(small, inputs, backprops, keep=kept)
        factors = torch.rand(2, generator=generator) + 0.5
        sums = experts_clipped_sum(small, inputs, backprops * factors.view(2, 1, 1))
        kept_sums = experts_kept_clipped_sum(small, kept, factors)
        close = lambda x, y: torch.allclose(x.double(), y.double(), rtol=1e-4, atol=1e-5 * float(y.abs().max()))  # noqa: E731
        return all(
            close(got[p], w) and close(squared[p], w.flatten(1).pow(2).sum(1))
            and close(sums[p], torch.einsum("i,i...->...", factors, w))
            and close(kept_sums[p], torch.einsum("i,i...->...", factors, w)) for p, w in want.items()
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
register_norm_sampler(predicate=looks_like_experts, clipped_sum=experts_clipped_sum, token_wise=True,
                      kept_clipped_sum=experts_kept_clipped_sum)(experts_norms_sq)
