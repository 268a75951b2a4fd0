"""What a sample can contribute to one step, and what it rests on.

- bf16 parameters: a sample's clipped contribution (what the controller adds for it alone) has a
  float64 norm of at most ``C``, with no slack, in every mode;
- ghost clipping is one ordinary backward pass, with or without ``DPLoss``, whose reduction must
  be the controller's;
- a subclass of a supported layer that overrides ``forward`` keeps the parent's sampler only if it
  reproduces torch.func, else takes the (exact) torch.func path; one that keeps the parent's
  forward keeps the fast path unchecked;
- ``nn.Embedding(max_norm=...)`` (and EmbeddingBag) writes the looked-up rows: refused, and fixed by
  renormalising every row instead;
- expanded weights follow a subclass's forward or refuse it at attach time.
"""

from __future__ import annotations

import weakref
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch import ModuleValidator
from dptorch.grad_sample import GradSampleHooks, UnsupportedModuleError, find_grad_sampler
from dptorch.grad_sample.layers import registry
from dptorch.grad_sample.modes.expanded_weights import zero_padding_rows
from dptorch.grad_sample.layers.embedding import RenormedEmbedding, RenormedEmbeddingBag
from dptorch.grad_sample.layers.linear import linear_grad_sampler, linear_norm_sampler
from dptorch.grad_sample.layers.registry import find_norm_sampler
from dptorch.grad_sample.capture.dp_loss import DPLoss
from dptorch.optim import DPOptimizer
from dptorch.clipping.factors import ROUNDING_MARGIN, clip_factors, flat_norms
from tests.helpers import call, check_per_sample_grads, projection_loss, reference_per_sample_grads

SOME = settings(max_examples=6, deadline=None)
C = 0.05


# ---------------------------------------------------------------------------------- one step, sample by sample


def step_contributions(model, inputs, mode, *, max_grad_norm=C, clipping="flat", loss_fn=projection_loss):
    """One noiseless DP step through the DP optimizer; for each sample, what the controller adds
    for it alone (its clip factor, every other factor zero), in float64, and the factors used."""
    n = inputs[0].shape[0]
    hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=mode)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=max_grad_norm, expected_batch_size=n, loss_reduction="sum", clipping=clipping)
    clipped_sums = hooks.clipped_sums
    seen = {}

    def recording(factors, *rest):
        seen["factors"] = factors
        alone = []
        for i in range(n):
            only_i = {p: f * (torch.arange(n) == i).to(f) for p, f in factors.items()}
            alone.append({p: s.double() for p, s in clipped_sums(only_i).items()})
        seen["alone"] = alone
        summed = clipped_sums(factors, *rest)
        seen["summed"] = {p: s.double() for p, s in summed.items()}
        return summed

    hooks.clipped_sums = recording
    try:
        output = call(model, inputs)
        loss = DPLoss(loss_fn, hooks)(output) if mode == "ghost" else loss_fn(output).sum()
        loss.backward()
        optimizer.step()
    finally:
        hooks.cleanup()
    return seen


def norm64(grads) -> float:
    return float(sum(g.double().pow(2).sum() for g in grads.values()) ** 0.5)


class TiedLM(nn.Module):
    """Embedding, a mixing layer, a LayerNorm and a head tied to the embedding."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(torch.tanh(self.mix(self.emb(ids)))))


def bf16_models():
    return {
        "mlp": (lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 5)),
                lambda g, n, t: (torch.randn(n, t, 6, generator=g),)),
        "tied_lm": (TiedLM, lambda g, n, t: (torch.randint(0, 11, (n, t), generator=g),)),
    }


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost", "ew"])
@pytest.mark.parametrize("name", ["mlp", "tied_lm"])
@SOME
@given(n=st.integers(1, 5), t=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_bf16_contribution_of_each_sample_is_at_most_C(name, mode, n, t, seed):
    """In float64, ``||contribution_i|| <= C`` exactly, and the contribution is the sample's own
    batch-of-one gradient times its factor (to bf16 accuracy), so the bound is not met vacuously."""
    if mode == "ew" and name == "tied_lm":
        return  # expanded weights cannot tie a weight across two layer types
    build, make_inputs = bf16_models()[name]
    torch.manual_seed(seed)
    model = build().to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in make_inputs(g, n, t))
    reference = reference_per_sample_grads(model, inputs, projection_loss)
    seen = step_contributions(model, inputs, mode)  # lr=0: the model is unchanged
    factor = next(iter(seen["factors"].values()))
    assert all(f is factor for f in seen["factors"].values())  # flat clipping: one factor per sample
    assert factor.dtype == torch.float32
    for i, alone in enumerate(seen["alone"]):
        assert norm64(alone) <= C, (i, norm64(alone) / C - 1)
        for p, got in alone.items():
            want = factor[i].double() * reference[p][i].double()
            torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max()) + 1e-7)
    assert (factor < 1).any()  # clipping was active
    for p, total in seen["summed"].items():  # the step is the sum of the contributions
        torch.testing.assert_close(total, sum(alone[p] for alone in seen["alone"]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@SOME
@given(n=st.integers(1, 4), t=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_bf16_per_layer_contributions_are_at_most_each_threshold(mode, n, t, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5)).to(torch.bfloat16)
    inputs = (torch.randn(n, t, 6, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16),)
    thresholds = [0.01, 0.02, 0.03, 0.04]
    seen = step_contributions(model, inputs, mode, max_grad_norm=thresholds, clipping="per_layer")
    for alone in seen["alone"]:
        for p, threshold in zip(model.parameters(), thresholds):
            assert float(alone[p].pow(2).sum().sqrt()) <= threshold


class TwoBranches(nn.Module):
    """Both trainable layers read the data and get the loss's own weights as output gradient: each
    sample's gradient is exact in float64 (bf16 values, exact products), whatever the kernels."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        self.lin = nn.Linear(6, 8)

    def forward(self, ids, x):
        return self.emb(ids) + self.lin(x)


def bf16_exact_projection(out):
    weights = torch.randn(out.shape[1:], generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    return (out * weights.to(out.dtype)).flatten(1).sum(1)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@SOME
@given(n=st.integers(1, 5), t=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_bf16_factor_times_exact_batch_of_one_gradient_is_at_most_C(mode, n, t, seed):
    """bk and ghost form norms and sums from the kept bf16 activations and output gradients in
    float32: the factor times the float64 batch-of-one gradient is within ``C``, no slack."""
    torch.manual_seed(seed)
    model = TwoBranches().to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    inputs = (torch.randint(0, 13, (n, t), generator=g), torch.randn(n, t, 6, generator=g).to(torch.bfloat16))
    exact = copy.deepcopy(model).double()
    reference = reference_per_sample_grads(exact, (inputs[0], inputs[1].double()), bf16_exact_projection)
    seen = step_contributions(model, inputs, mode, loss_fn=bf16_exact_projection)
    factor = next(iter(seen["factors"].values())).double()
    names = dict(zip(model.parameters(), exact.parameters()))
    for i in range(n):
        assert norm64({p: factor[i] * reference[names[p]][i] for p in names}) <= C
    assert (factor < 1).any()


@settings(max_examples=200, deadline=None)
@given(norm=st.floats(2.0**-100, 2.0**100, width=32), threshold=st.floats(2.0**-20, 2.0**20, width=32))
def test_clip_factor_keeps_its_margin_in_float64(norm, threshold):
    norms = torch.tensor([norm], dtype=torch.float32)
    factor = clip_factors(norms, threshold)
    assert factor.dtype == torch.float32 and 0 < float(factor) <= 1
    assert float(factor.double()) * norm * (1 + ROUNDING_MARGIN / 2) <= threshold


def test_clip_factors_stay_float32_for_bf16_norms_and_flat_norms_sum_in_float64():
    norms = {0: torch.tensor([3.0, 0.5], dtype=torch.bfloat16), 1: torch.tensor([4.0, 0.5], dtype=torch.float32)}
    total = flat_norms(norms)
    assert total.dtype == torch.float64 and total.tolist() == pytest.approx([5.0, 0.5**0.5], rel=1e-15)
    assert clip_factors(norms[0], 1.0).dtype == torch.float32


def test_full_precision_matmuls_restore_every_user_setting():
    """Inside, float32 matmuls are full precision; after, the user's setting (legacy or per-backend
    API, never mixed) reads back as before. A subprocess: the settings are process-wide."""
    code = r"""
import torch
from dptorch.grad_sample.modes.precision import float32_matmuls_at_full_precision as full
new_api = hasattr(torch.backends.cuda.matmul, "fp32_precision")
def state():
    if new_api:
        return (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    return (torch.get_float32_matmul_precision(),)
def full_inside():
    if new_api:
        return state() == ("ieee", "ieee") or state() == ("none", "none") and torch.backends.fp32_precision in ("none", "ieee")
    return state() == ("highest",)
settings = [lambda: None, lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
            lambda: torch.set_float32_matmul_precision("medium")]
if new_api:
    settings.append(lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"))
for i, apply in enumerate(settings):
    apply()
    before = state()
    with full():
        assert full_inside(), (i, state())
        torch.ones(2, 2) @ torch.ones(2, 2)
    assert state() == before, (i, before, state())
    if i == 1:
        assert torch.backends.cuda.matmul.allow_tf32  # the legacy API still reads (no mixing)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# ---------------------------------------------------------------------------------- ghost: one pass, DPLoss


def test_ghost_is_one_backward_pass_with_or_without_the_loss_wrapper():
    """Ghost forms its clipped sum from the captured activations and output gradients, as bk does:
    one ordinary backward, DPLoss optional (it keeps Opacus code working), the hooks-mode step."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, target = torch.randn(5, 4), torch.randint(0, 3, (5,))
    steps = {}
    for mode, wrapped in (("hooks", False), ("ghost", True), ("ghost", False)):
        model = copy.deepcopy(base)
        hooks = GradSampleHooks(model, grad_sample_mode=mode)
        optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0,
                                max_grad_norm=0.1, expected_batch_size=5)
        passes = []
        model[0].weight.register_hook(lambda grad: passes.append(1))  # autograd passes reaching it, if any
        criterion = DPLoss(nn.CrossEntropyLoss(), hooks) if wrapped else nn.CrossEntropyLoss()
        criterion(model(x), target).backward()
        optimizer.step()
        hooks.cleanup()
        assert len(passes) <= 1, (mode, wrapped)
        steps[(mode, wrapped)] = [p.detach() for p in model.parameters()]
    for key in (("ghost", True), ("ghost", False)):
        for a, b in zip(steps[("hooks", False)], steps[key]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dploss_refuses_a_reduction_that_contradicts_the_controller():
    model = nn.Linear(4, 3)
    for controller, wrapper in (("mean", "sum"), ("sum", "mean")):
        hooks = GradSampleHooks(model, grad_sample_mode="ghost", loss_reduction=controller)
        with pytest.raises(ValueError, match=rf"loss_reduction='{wrapper}'.*controller's loss_reduction='{controller}'"):
            DPLoss(nn.CrossEntropyLoss(), hooks, loss_reduction=wrapper)
        assert DPLoss(nn.CrossEntropyLoss(), hooks, loss_reduction=controller).loss_reduction == controller
        assert DPLoss(nn.CrossEntropyLoss(), hooks).loss_reduction == controller
        hooks.cleanup()
    hooks = GradSampleHooks(model)
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        DPLoss(nn.CrossEntropyLoss(), hooks, loss_reduction="avg")
    hooks.cleanup()


# ---------------------------------------------------------------------------------- subclassed layers


class PlainLinear(nn.Linear):
    """Keeps nn.Linear's forward."""


class PassThroughLinear(nn.Linear):
    """Overrides forward without changing what it computes."""

    def forward(self, x):
        return super().forward(x)


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 3.0 * super().forward(x) + 0.5 * super().forward(x.flip(-1))


class MaskedLinear(nn.Linear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("mask", (torch.arange(self.weight.numel()) % 3 != 0).float().view_as(self.weight))

    def forward(self, x):
        return F.linear(x, self.weight * self.mask, self.bias)


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return 2.0 * super().forward(ids)


class ScaledLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 0.5 + self.weight


class StridedConv(nn.Conv1d):
    def forward(self, x):
        return super().forward(x[..., ::2])


def test_a_subclass_that_keeps_forward_keeps_the_fast_path_unchecked(monkeypatch):
    monkeypatch.setattr(registry, "matches_torch_func", lambda *a, **k: pytest.fail("checked a subclass without a forward"))
    assert find_grad_sampler(PlainLinear(3, 2)) is linear_grad_sampler
    assert find_norm_sampler(PlainLinear(3, 2)).norms_sq is linear_norm_sampler
    assert find_grad_sampler(nn.modules.linear.NonDynamicallyQuantizableLinear(3, 2)) is linear_grad_sampler


def test_a_subclass_whose_forward_matches_is_checked_once_per_instance(monkeypatch):
    calls = []
    check = registry.matches_torch_func

    def counting(module, *args, **kwargs):
        calls.append((type(module), "norm" if kwargs.get("norm_sampler") else "grad"))
        return check(module, *args, **kwargs)

    monkeypatch.setattr(registry, "_VERIFIED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(registry, "matches_torch_func", counting)
    first, second = PassThroughLinear(3, 2), PassThroughLinear(5, 4, bias=False)
    for module in (first, second, first):
        assert find_grad_sampler(module) is linear_grad_sampler
        assert find_norm_sampler(module).norms_sq is linear_norm_sampler
    assert calls == [(PassThroughLinear, "grad"), (PassThroughLinear, "norm")] * 2


class AttributeScaledLinear(nn.Linear):
    """What forward computes depends on an instance attribute."""

    def __init__(self, *args, scale=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def forward(self, x):
        return super().forward(x) * self.scale


def test_one_instance_never_vouches_for_another():
    assert find_grad_sampler(AttributeScaledLinear(3, 2, scale=1.0)) is linear_grad_sampler
    assert find_grad_sampler(AttributeScaledLinear(3, 2, scale=3.0)) is not linear_grad_sampler


DIFFERENT = {
    "scaled_linear": (lambda: ScaledLinear(6, 5), lambda g, n, t: (torch.randn(n, t, 6, generator=g),)),
    "masked_linear": (lambda: MaskedLinear(6, 5), lambda g, n, t: (torch.randn(n, t, 6, generator=g),)),
    "scaled_embedding": (lambda: ScaledEmbedding(9, 5), lambda g, n, t: (torch.randint(0, 9, (n, t), generator=g),)),
    "scaled_layer_norm": (lambda: ScaledLayerNorm(6), lambda g, n, t: (torch.randn(n, t, 6, generator=g),)),
    "strided_conv": (lambda: StridedConv(6, 5, 2), lambda g, n, t: (torch.randn(n, 6, 2 * t + 4, generator=g),)),
}


@pytest.mark.parametrize("name", list(DIFFERENT))
def test_a_subclass_whose_forward_differs_gets_no_inherited_sampler(name):
    layer = DIFFERENT[name][0]()
    assert find_grad_sampler(layer) is None and find_norm_sampler(layer) is None


def subclass_model(name):
    layer = DIFFERENT[name][0]()
    return nn.Sequential(layer, nn.Tanh(), nn.Flatten(1), nn.LazyLinear(3))


@pytest.mark.parametrize("name", list(DIFFERENT))
@settings(max_examples=3, deadline=None)
@given(n=st.integers(1, 4), t=st.integers(1, 3))
def test_a_subclass_whose_forward_differs_is_exact_in_every_mode(name, n, t):
    """Against the batch-of-one oracle: per-sample gradients (hooks), the clipped step (bk, ghost),
    and each sample's contribution within ``C``."""
    g = torch.Generator().manual_seed(n * 7 + t)
    inputs = DIFFERENT[name][1](g, n, t)
    torch.manual_seed(0)
    model = subclass_model(name)
    model(*inputs)  # materialise the lazy head
    check_per_sample_grads(copy.deepcopy(model), inputs, loss_reduction="sum")
    reference = reference_per_sample_grads(model, inputs, projection_loss)
    norms = torch.stack([r.flatten(1).double().pow(2).sum(1) for r in reference.values()]).sum(0).sqrt()
    for mode in ("hooks", "bk", "ghost"):
        trial = copy.deepcopy(model)
        seen = step_contributions(trial, inputs, mode)
        factor = next(iter(seen["factors"].values())).double()
        torch.testing.assert_close(factor, clip_factors(norms, C).double(), rtol=1e-4, atol=1e-7)
        names = dict(zip(trial.parameters(), model.parameters()))
        for i, alone in enumerate(seen["alone"]):
            assert norm64(alone) <= C, (mode, i)
            for p, got in alone.items():
                want = factor[i] * reference[names[p]][i].double()
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-9)


def test_opt_positional_embedding_is_exact():
    """OPT's positional embedding subclasses nn.Embedding and looks up positions computed from the
    attention mask it is called with: the inherited sampler would scatter into the mask's rows."""
    transformers = pytest.importorskip("transformers")
    positions = transformers.models.opt.modeling_opt.OPTLearnedPositionalEmbedding(16, 8)
    assert find_grad_sampler(positions) is None
    mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    check_per_sample_grads(positions, (mask,))


# ---------------------------------------------------------------------------------- Embedding(max_norm)


def embedding_models():
    return {
        "embedding": nn.Sequential(nn.Embedding(12, 4, max_norm=1.0), nn.Linear(4, 3)),
        "embedding_bag": nn.Sequential(nn.EmbeddingBag(12, 4, max_norm=1.0, mode="mean"), nn.Linear(4, 3)),
    }


@pytest.mark.parametrize("name", ["embedding", "embedding_bag"])
def test_max_norm_is_reported_and_refused_in_every_mode(name):
    model = embedding_models()[name]
    nn.init.normal_(model[0].weight, std=3.0)
    problems = ModuleValidator.validate(model)
    assert [(p.path, p.module_type) for p in problems] == [("0", type(model[0]).__name__)]
    assert "max_norm=1.0" in problems[0].reason and "ModuleValidator.fix" in problems[0].reason
    for mode in ("hooks", "bk", "ghost", "functorch", "ew"):
        if mode == "ew" and name == "embedding_bag":
            continue  # refused for its type already
        with pytest.raises(UnsupportedModuleError, match=r"0 \(Embedding(Bag)?\): max_norm=1.0 renormalises"):
            GradSampleHooks(model, grad_sample_mode=mode)
    model[0].weight.requires_grad_(False)  # a frozen table is released with the model: still refused
    assert ModuleValidator.validate(model)
    without = nn.Sequential(nn.Embedding(12, 4), nn.EmbeddingBag(12, 4))
    assert ModuleValidator.validate(without) == []


@pytest.mark.parametrize("name", ["embedding", "embedding_bag"])
def test_fix_renormalises_every_row_independently_of_the_data(name):
    torch.manual_seed(0)
    model = embedding_models()[name]
    nn.init.normal_(model[0].weight, std=3.0)
    fixed = ModuleValidator.fix(model)
    assert type(fixed[0]) is {"embedding": RenormedEmbedding, "embedding_bag": RenormedEmbeddingBag}[name]
    assert fixed[0].max_norm is None and fixed[0].renorm_max_norm == 1.0
    assert ModuleValidator.validate(fixed) == []
    assert type(model[0]) in (nn.Embedding, nn.EmbeddingBag) and model[0].max_norm == 1.0  # the input is untouched
    first, second = torch.tensor([[1, 2, 3]]), torch.tensor([[7, 8, 8]])
    # torch's layer: the weights afterwards depend on which rows the batch looked up
    after = [copy.deepcopy(model) for _ in range(2)]
    for m, ids in zip(after, (first, second)):
        m(ids)
    assert not torch.equal(after[0][0].weight, after[1][0].weight)
    # the fixed layer: the same rows as torch's, and weights that do not depend on the batch
    fixed_after = [copy.deepcopy(fixed) for _ in range(2)]
    for m, torch_m, ids in zip(fixed_after, after, (first, second)):
        torch.testing.assert_close(m(ids), torch_m(ids))
    assert torch.equal(fixed_after[0][0].weight, fixed_after[1][0].weight)
    assert float(fixed_after[0][0].weight.detach().norm(dim=1).max()) <= 1.0


def test_fixed_embedding_is_exact_in_every_mode():
    torch.manual_seed(0)
    model = ModuleValidator.fix(nn.Sequential(nn.Embedding(12, 4, max_norm=1.0, padding_idx=0), nn.Linear(4, 3)))
    nn.init.normal_(model[0].weight, std=3.0)
    ids = torch.randint(0, 12, (4, 5))
    for mode in ("hooks", "functorch"):
        check_per_sample_grads(copy.deepcopy(model), (ids,), grad_sample_mode=mode)
    without_padding = copy.deepcopy(model)
    without_padding[0].padding_idx = None  # torch's expanded weights ignore padding_idx (see below)
    check_per_sample_grads(without_padding, (ids,), grad_sample_mode="ew")
    assert find_norm_sampler(model[0]) is not None
    reference = reference_per_sample_grads(model, (ids,), projection_loss)
    for mode in ("bk", "ghost"):
        trial = copy.deepcopy(model)
        seen = step_contributions(trial, (ids,), mode)
        factor = next(iter(seen["factors"].values())).double()
        names = dict(zip(trial.parameters(), model.parameters()))
        assert set(names[p] for p in seen["summed"]) == set(reference)
        for p, total in seen["summed"].items():
            want = torch.einsum("i,i...->...", factor, reference[names[p]].double())
            torch.testing.assert_close(total, want, rtol=1e-4, atol=1e-6)
    bag = ModuleValidator.fix(nn.Sequential(nn.EmbeddingBag(12, 4, max_norm=1.0, mode="max"), nn.Linear(4, 3)))
    nn.init.normal_(bag[0].weight, std=3.0)
    check_per_sample_grads(bag, (ids,))


def test_a_subclass_with_max_norm_stays_reported():
    model = nn.Sequential(ScaledEmbedding(12, 4, max_norm=1.0))
    with pytest.raises(UnsupportedModuleError, match=r"(?s)could not make the model compatible.*ScaledEmbedding.*"
                       r"max_norm=1.0.*set max_norm=None and renormalise every row"):
        ModuleValidator.fix(model)


# ---------------------------------------------------------------------------------- expanded weights


def test_expanded_weights_follow_a_subclass_forward_or_refuse_it_at_attach():
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(4, 5), nn.Tanh(), PassThroughLinear(5, 2))
    check_per_sample_grads(model, (torch.randn(3, 2, 4),), grad_sample_mode="ew")
    with pytest.raises(UnsupportedModuleError, match=r"0 \(MaskedLinear\): its class overrides forward.*'hooks'"):
        GradSampleHooks(nn.Sequential(MaskedLinear(4, 5)), grad_sample_mode="ew")


def test_expanded_weights_padding_row_is_zeroed_and_scale_grad_by_freq_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=0), nn.Linear(4, 3))
    ids = torch.tensor([[0, 1, 2], [3, 0, 0]])
    reference = reference_per_sample_grads(model, (ids,), projection_loss)
    with GradSampleHooks(model, grad_sample_mode="ew") as hooks:
        projection_loss(model(ids)).mean().backward()
        grads = hooks.grad_samples
        assert grads[model[0].weight][:, 0].abs().sum() > 0  # torch's rule fills the padding row
        zero_padding_rows(model, grads)
    for p, want in reference.items():
        torch.testing.assert_close(grads[p], want, rtol=1e-4, atol=1e-6)
    with pytest.raises(UnsupportedModuleError, match=r"0 \(Embedding\): scale_grad_by_freq=True"):
        GradSampleHooks(nn.Sequential(nn.Embedding(6, 4, scale_grad_by_freq=True)), grad_sample_mode="ew")


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_float64_model_takes_a_step_within_C(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5)).double()
    inputs = (torch.randn(4, 3, 6, dtype=torch.float64),)
    reference = reference_per_sample_grads(model, inputs, projection_loss)
    seen = step_contributions(model, inputs, mode)
    factor = next(iter(seen["factors"].values())).double()
    for i, alone in enumerate(seen["alone"]):
        assert norm64(alone) <= C
        for p, got in alone.items():
            torch.testing.assert_close(got, factor[i] * reference[p][i], rtol=1e-5, atol=1e-9)
