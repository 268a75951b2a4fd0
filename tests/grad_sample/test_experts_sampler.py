"""The mixture-of-experts rule (``layers/experts.py``) against each sample's own gradient: the pure math
on an expert bank called with a batch, a sparse MoE block (router, experts, Qwen2-MoE's shared expert)
under the controller, and the zoo's whole Mixtral, in every experts implementation transformers has."""

from __future__ import annotations

import importlib

import pytest
import torch

from dptorch.grad_sample import GradSampleHooks, registry
from dptorch.grad_sample.norms.exact_products import use_route
from tests.grad_sample.oracle import assert_exact, oracle
from tests.helpers import projection_loss, single_thread  # noqa: F401  (autouse: one intra-op thread)

transformers = pytest.importorskip("transformers")
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
H, I = 8, 8  # multiples of 16 bytes, as grouped_mm needs


@pytest.fixture
def experts():
    """The rule's module (``dptorch.grad_sample.layers`` imports it, which registers it)."""
    return importlib.import_module("dptorch.grad_sample.layers.experts")


def config(family: str, impl: str, experts: int = 5):
    common = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2,
                  num_hidden_layers=1, vocab_size=100, max_position_embeddings=16, router_aux_loss_coef=0.0,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "mixtral":
        made = transformers.MixtralConfig(intermediate_size=I, num_local_experts=experts, router_jitter_noise=0.0, **common)
    elif family == "qwen2_moe":
        made = transformers.Qwen2MoeConfig(intermediate_size=I, moe_intermediate_size=I, shared_expert_intermediate_size=I,
                                           num_experts=experts, **common)
    else:
        made = transformers.OlmoeConfig(intermediate_size=I, num_experts=experts, **common)
    made._experts_implementation = impl
    return made


def block(family: str, impl: str) -> torch.nn.Module:
    classes = {"mixtral": transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock,
               "qwen2_moe": transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock,
               "olmoe": transformers.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock}
    made = classes[family](config(family, impl)).train()
    for p in made.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return made


def routed_batch(n: int, t: int, experts: int, g: torch.Generator):
    """Tokens ``(n, t, H)`` with distinct top-2 experts each; sample 0 sends all its tokens to experts 3 and 1."""
    x = torch.randn(n, t, H, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(n * t)]).view(n, t, 2)
    index[0, :, 0], index[0, :, 1] = 3, 1
    return x, index, torch.rand(n, t, 2, generator=g)


def each_alone(bank, x, index, weights, backprops):
    """Each sample's gradients of the bank's two weights, from its own autograd call."""
    params = [bank.gate_up_proj, bank.down_proj]
    alone = [torch.autograd.grad((bank(x[i], index[i], weights[i]) * backprops[i]).sum(), params) for i in range(len(x))]
    return {p: torch.stack([a[j] for a in alone]) for j, p in enumerate(params)}


@pytest.mark.parametrize("route", ["float64", "split"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_math_matches_each_sample_alone(experts, impl, route):
    """Per-sample gradients, certified norms (on both routes of the certified products), and the clipped
    sum both from scaled output gradients and from the factors the norm pass kept."""
    bank = block("mixtral", impl).experts
    n, t = 3, 4
    g = torch.Generator().manual_seed(0)
    x, index, weights = routed_batch(n, t, 5, g)
    backprops = torch.randn(n, t, H, generator=g)
    want = each_alone(bank, x, index, weights, backprops)
    got = experts.experts_grad_sampler(bank, (x, index, weights), backprops)
    kept = {}
    with use_route(route):
        squared = experts.experts_norms_sq(bank, (x, index, weights), backprops, keep=kept)
    factors = torch.rand(n, generator=g)
    sums = experts.experts_clipped_sum(bank, (x, index, weights), backprops * factors.view(n, 1, 1))
    kept_sums = experts.experts_kept_clipped_sum(bank, kept, factors)
    for p, w in want.items():
        close = dict(rtol=1e-5, atol=1e-6 * float(w.abs().max()))
        torch.testing.assert_close(got[p], w, **close)
        torch.testing.assert_close(squared[p].sqrt().float(), w.flatten(1).norm(dim=1), **close)
        torch.testing.assert_close(sums[p], torch.einsum("i,i...->...", factors, w), **close)
        torch.testing.assert_close(kept_sums[p], torch.einsum("i,i...->...", factors, w), **close)
    assert bool((want[bank.gate_up_proj][0, [0, 2, 4]] == 0).all())  # sample 0 used experts 1 and 3 only


@pytest.mark.parametrize("mode", ["bk", "hooks", "ghost"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_moe_block_is_exact(experts, family, mode):
    """Router (torch.func fallback), experts (the rule), shared expert (Linear) on ``(B * T, H)`` rows."""
    torch.manual_seed(0)
    model = block(family, "eager")
    x = torch.randn(3, 4, H, generator=torch.Generator().manual_seed(1))
    assert_exact(model, (x,), (0,), projection_loss, mode, 3)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("size", [(3, 5), (4, 4)])
def test_whole_mixtral_is_exact(experts, impl, size):
    from tests.models.zoo import ZOO

    torch.manual_seed(0)
    model = ZOO["mixtral"].build()
    model.set_experts_implementation(impl)
    n, t = size
    inputs = ZOO["mixtral"].inputs(n, t, torch.Generator().manual_seed(n * 31 + t))
    assert_exact(model, inputs, {k: 0 for k in inputs}, ZOO["mixtral"].loss, "bk", n)


def test_a_bank_whose_forward_differs_gets_no_rule(experts):
    """The check runs the bank's own forward: a class with the layout whose forward computes something
    else fails it, and is left to the torch.func fallback."""
    base = type(block("mixtral", "eager").experts)

    class Doubled(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    bank = Doubled(config("mixtral", "eager"))
    for p in bank.parameters():
        torch.nn.init.normal_(p)
    assert experts.looks_like_experts(bank)
    assert registry.find_grad_sampler(bank) is None and registry.find_norm_sampler(bank) is None
    assert registry.find_grad_sampler(block("mixtral", "eager").experts) is experts.experts_grad_sampler


def test_other_layouts_and_gates_are_not_taken_for_experts(experts):
    base = type(block("mixtral", "eager").experts)

    class OtherGate(base):  # e.g. a clamped gate: its Jacobian is not the one the norms bound
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.tanh(gate) * up

    assert not experts.looks_like_experts(OtherGate(config("mixtral", "eager")))
    bank = block("mixtral", "eager").experts
    bank.is_transposed = True
    assert not experts.looks_like_experts(bank)
    with GradSampleHooks(bank, grad_sample_mode="bk") as hooks:
        assert hooks._layers[bank].sampler is None


@pytest.mark.parametrize("mode", ["bk", "hooks"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_an_empty_batch_is_a_zero_step(experts, impl, mode):
    from tests.grad_sample.test_empty_batches import empty_step

    model = block("mixtral", impl)
    params = [p for p in model.parameters() if p.requires_grad]
    seen = empty_step(model, (torch.zeros(0, 4, H),), mode)
    assert seen["batch"] == 0 and set(seen["norms"]) == set(params)
    assert all(norm.shape == (0,) for norm in seen["norms"].values())
    assert all(summed.shape == p.shape and not summed.any() for p, summed in seen["sums"].items())


# ----------------------------------------------------------------------------- the norm pass's factors, kept


def counting_factors(monkeypatch, experts, bank) -> list:
    """Counts the calls of ``expert_factors`` on ``bank`` (the rule's check runs on small copies, other modules)."""
    calls, original = [], experts.expert_factors

    def counted(module, *args, **kwargs):
        if module is bank:
            calls.append(1)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(experts, "expert_factors", counted)
    return calls


def assert_sums(sums, factor, want):
    for p, w in want.items():
        torch.testing.assert_close(sums[p], torch.einsum("i,i...->...", factor, w), rtol=1e-5, atol=1e-6 * float(w.abs().max()))


@pytest.mark.parametrize("route", ["float64", "split"])
def test_factors_are_computed_once_per_call_and_step(experts, monkeypatch, route):
    """bk: the clipped sum is formed from the norm pass's factors (one computation per call of the bank per
    step), and nothing kept outlives its step: the next step's sums, asked before its norms, are recomputed
    from its own batch, then formed from its own norm pass."""
    torch.manual_seed(0)
    model = block("mixtral", "eager")
    batches = [torch.randn(3, 4, H, generator=torch.Generator().manual_seed(step)) for step in range(2)]
    wants = [oracle(model, (x,), (0,), projection_loss, 3) for x in batches]
    calls = counting_factors(monkeypatch, experts, model.experts)
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    try:
        with use_route(route):
            for step, (x, want) in enumerate(zip(batches, wants)):
                projection_loss(model(x)).sum().backward()
                factor = torch.rand(3, generator=torch.Generator().manual_seed(10 + step))
                if step:  # no norm pass yet: recomputed
                    assert_sums(hooks.clipped_sums({p: factor for p in want}), factor, want)
                    assert len(calls) == 2
                norms = hooks.per_sample_norms()
                assert_sums(hooks.clipped_sums({p: factor for p in want}), factor, want)
                for p in (model.experts.gate_up_proj, model.experts.down_proj):
                    torch.testing.assert_close(norms[p], want[p].flatten(1).norm(dim=1), rtol=1e-5, atol=0)
                assert len(calls) == 1 + 2 * step
                hooks.clear()  # as the DP optimizer's step does
    finally:
        hooks.cleanup()


def test_each_call_of_a_bank_keeps_its_own_factors(experts):
    """Two calls of one bank: each call's clipped sum is formed from its own norm pass (not the bank's
    latest), and a call whose output gradient changed since, in place or for another tensor, keeps none."""
    from dptorch.grad_sample.modes.layer_call import LayerCall

    bank = block("mixtral", "eager").experts
    norm_sampler = registry.find_norm_sampler(bank)
    g = torch.Generator().manual_seed(5)
    calls, wants = [], []
    for _ in range(2):
        x, index, weights = routed_batch(3, 4, 5, g)
        backprops = torch.randn(3, 4, H, generator=g)
        wants.append(each_alone(bank, x, index, weights, backprops))
        calls.append(LayerCall("experts", bank, dict(bank.named_parameters()), experts.experts_grad_sampler,
                               norm_sampler, (x, index, weights), backprops))
    for call in calls:
        call.norms_sq()
    factor = torch.rand(3, generator=g)
    for call, want in zip(calls, wants):
        assert_sums(norm_sampler.kept_clipped_sum(bank, call.kept_norm_pass(), factor, None), factor, want)
    calls[0].backprops.mul_(2)
    calls[1].backprops = calls[1].backprops.clone()
    assert calls[0].kept_norm_pass() is None and calls[1].kept_norm_pass() is None


def test_a_bank_called_twice_in_one_forward_is_exact(experts):
    class Twice(torch.nn.Module):
        def __init__(self, bank):
            super().__init__()
            self.bank = bank

        def forward(self, x, index, weights):
            rows = (x.shape[0] * x.shape[1], -1)
            once = self.bank(x.reshape(rows), index.reshape(rows), weights.reshape(rows))
            return self.bank(once, index.flip(-1).reshape(rows), weights.reshape(rows)).view(x.shape)

    torch.manual_seed(0)
    model = Twice(block("mixtral", "eager").experts)
    assert_exact(model, routed_batch(3, 4, 5, torch.Generator().manual_seed(4)), (0, 0, 0), projection_loss, "bk", 3)


def test_dropped_units_add_nothing_through_the_kept_factors(experts, monkeypatch):
    """A sample with an inf input (its factors inf or NaN) dropped: the others' clipped sum, exactly, from the
    kept factors (no per-sample gradient instantiated for the dropped rows)."""
    torch.manual_seed(0)
    model = block("mixtral", "eager")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4, H, generator=g)
    x[1, 2, 0] = float("inf")
    kept_rows = [0, 2, 3]
    want = oracle(model, (x[kept_rows],), (0,), projection_loss, 3)
    calls = counting_factors(monkeypatch, experts, model.experts)
    factor = torch.rand(4, generator=g)
    with GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum") as hooks:
        projection_loss(model(x)).sum().backward()
        norms = hooks.per_sample_norms()
        assert not torch.isfinite(norms[model.experts.gate_up_proj][1])
        dropped = torch.tensor([False, True, False, False])
        sums = hooks.clipped_sums({p: factor for p in want}, dropped)
        assert all(torch.isfinite(s).all() for s in sums.values())
        assert_sums(sums, factor[kept_rows], want)
        assert len(calls) == 1


class ProjectedBank(torch.nn.Module):
    """``bank(x) * g`` on ``(B, T, H)`` tokens: the bank's output gradient is ``g``, a per-sample input."""

    def __init__(self, bank):
        super().__init__()
        self.bank = bank

    def forward(self, x, index, weights, g):
        rows = (x.shape[0] * x.shape[1], -1)
        return self.bank(x.reshape(rows), index.reshape(rows), weights.reshape(rows)).view(x.shape) * g


@pytest.mark.parametrize("route", ["float64", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_exp, delta_exp", [(12, 0), (24, -2), (30, 4)])
def test_a_cancelling_record_is_clipped(experts, route, dtype, k_exp, delta_exp):
    """Sample 0: two identical tokens routed alike, output gradients ``K u`` and ``-K u + delta``, so its
    ``du`` and ``w g`` cancel. What the clipped sum adds for each sample at a factor ``c`` has a float64
    norm within ``c N`` (``N`` its certified norm, with the clip factors' margin), and so has its exact
    gradient (float64, of the inputs as rounded to ``dtype``)."""
    from dptorch.clipping.factors import ROUNDING_MARGIN

    torch.manual_seed(0)
    model = ProjectedBank(block("mixtral", "eager").experts).to(dtype)
    g = torch.Generator().manual_seed(k_exp)
    n, t = 3, 3
    x, index, weights = routed_batch(n, t, 5, g)
    out_grad = torch.randn(n, t, H, generator=g, dtype=torch.float64)
    x[0, 1], index[0, 1], weights[0, 1] = x[0, 0], index[0, 0], weights[0, 0]
    u, v = (w / w.norm() for w in torch.randn(2, H, generator=g, dtype=torch.float64))
    out_grad[0, 0], out_grad[0, 1] = 2.0**k_exp * u, -(2.0**k_exp) * u + 2.0**delta_exp * v
    inputs = (x.to(dtype), index, weights.to(dtype), out_grad.to(dtype))
    model64 = ProjectedBank(block("mixtral", "eager").experts).double()
    model64.load_state_dict(model.state_dict())
    exact = oracle(model64, tuple(t.double() if t.is_floating_point() else t for t in inputs), (0, 0, 0, 0),
                   lambda out: out.flatten(1).sum(1), n)
    exact = torch.stack([w.flatten(1).pow(2).sum(1) for w in exact.values()]).sum(0).sqrt()
    c = 1 / 3
    with use_route(route), GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum") as hooks:
        model(*inputs).sum().backward()
        norms = hooks.per_sample_norms()
        bound = torch.stack([m.double().square() for m in norms.values()]).sum(0).sqrt() * (1 + ROUNDING_MARGIN)
        for i in range(n):
            only = c * (torch.arange(n) == i).float()
            added = hooks.clipped_sums({p: only for p in norms})
            assert sum(s.double().square().sum() for s in added.values()).sqrt() <= c * bound[i], i
            assert exact[i] <= bound[i], (i, float(exact[i]), float(bound[i]))
