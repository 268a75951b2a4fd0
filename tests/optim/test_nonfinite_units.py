"""A unit whose gradient is not finite contributes exactly zero; the other units are unaffected.

One batch holds a unit with an ``inf`` feature and one whose loss term is ``log(0)`` (its output
gradient is NaN). In every mode, with flat, per-layer, automatic and adaptive clipping, in float32
and bf16, the step must equal the one built from the batch-of-one gradients of the other units
alone (float64), the parameters stay finite, the count of dropped units is released only noised
(``clipping_stats="private"``) or flagged (``"raw"``), and the warning names no unit.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks, register_grad_sampler
from dptorch.grad_sample.layers.registry import register_norm_sampler
from dptorch.noise import NoiseGenerator
from dptorch.optim import DPOptimizer, NonFiniteGradientWarning
from dptorch.clipping.factors import ROUNDING_MARGIN
from tests.helpers import projection_loss, single_thread  # noqa: F401  (autouse fixture)

MODES = ["hooks", "bk", "ghost", "functorch", "ew"]
N, INF_UNIT, LOG0_UNIT = 6, 1, 4
KEPT = [i for i in range(N) if i not in (INF_UNIT, LOG0_UNIT)]


class Gain(nn.Module):
    """``x * w``: a layer with its own grad and norm samplers whose clipped sum reads a float input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


@register_grad_sampler(Gain)
def _gain_grad_sampler(module, activations, backprops):
    x = activations[0]
    return {module.weight: (x * backprops).reshape(x.shape[0], -1, x.shape[-1]).sum(1)}


def _gain_clipped_sum(module, activations, scaled_backprops):
    x = activations[0]
    return {module.weight: (x * scaled_backprops).reshape(-1, x.shape[-1]).sum(0)}


@register_norm_sampler(Gain, clipped_sum=_gain_clipped_sum)
def _gain_norms(module, activations, backprops):
    return {module.weight: _gain_grad_sampler(module, activations, backprops)[module.weight].pow(2).sum(1)}


class Net(nn.Module):
    """Embedding + Linear input, LayerNorm (instantiated in bk), a Gain, two Linears reading one
    input (a shared-input group), a head: every clipped-sum path of every strategy."""

    def __init__(self, width: int, gain: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, width)
        self.inp = nn.Linear(3, width)
        self.norm = nn.LayerNorm(width)
        self.gain = Gain(width) if gain else nn.Identity()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.gain(self.norm(self.emb(ids) + self.inp(x)))
        return self.head(torch.tanh(self.q(h)) * self.k(h)).mean(1)


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A projection plus ``-log(p . t)``: ``log(0)`` for a unit whose soft target row is zero."""
    return projection_loss(logits) - (logits.float().softmax(-1) * targets).sum(-1).log()


def batch(width_tokens: int, dtype=torch.float32, bad: bool = True):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 11, (N, width_tokens), generator=g)
    x = torch.randn(N, width_tokens, 3, generator=g).to(dtype)
    targets = torch.rand(N, 4, generator=g) + 0.1
    if bad:
        x[INF_UNIT, 0, 1] = float("inf")
        targets[LOG0_UNIT] = 0.0
    return ids, x, targets


def build(mode: str, width: int, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return Net(width, gain=mode != "ew").to(dtype)  # expanded weights refuse a custom layer


def dp_step(model, mode, inputs, *, clipping="flat", max_grad_norm=1.0, **options):
    """One noiseless DP step (SGD, lr 1, summed loss); returns ``before - after`` per parameter and the optimizer."""
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0,
                      max_grad_norm=max_grad_norm, loss_reduction="sum", clipping=clipping,
                      noise_generator=NoiseGenerator(seed=3), **options)
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ids, x, targets = inputs
    try:
        per_sample_loss(model(ids, x), targets).sum().backward()
        opt.step()
    finally:
        hooks.cleanup()
    return {n: before[n] - p.detach().double() for n, p in model.named_parameters()}, opt


def reference_update(model, inputs, units, *, clipping="flat", max_grad_norm=1.0, gamma=0.01):
    """``sum_i c_i g_i`` over ``units`` from batch-of-one gradients, in float64."""
    ids, x, targets = inputs
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = []
    for i in units:
        model.zero_grad(set_to_none=True)
        per_sample_loss(model(ids[i:i + 1], x[i:i + 1]), targets[i:i + 1]).sum().backward()
        grads.append({n: p.grad.double().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    total = {n: torch.zeros_like(grads[0][n]) for n in names}
    for g in grads:
        assert all(torch.isfinite(v).all() for v in g.values()), "a kept unit's reference gradient is not finite"
        norm = sum(v.pow(2).sum() for v in g.values()).sqrt() * (1 + ROUNDING_MARGIN)
        for k, n in enumerate(names):
            if clipping == "automatic":
                factor = 1 / (norm + gamma)
            elif clipping == "per_layer":
                factor = (max_grad_norm[k] / (g[n].norm() * (1 + ROUNDING_MARGIN) + 1e-6)).clamp(max=1)
            else:
                factor = (max_grad_norm / (norm + 1e-6)).clamp(max=1)
            total[n] += factor * g[n]
    return total


def assert_updates_equal(got, want, rtol):
    scale = max(float(v.abs().max()) for v in want.values())
    for n in want:
        assert torch.isfinite(got[n]).all(), f"{n}: not finite after the step"
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=rtol * scale, msg=lambda m: f"{n}: {m}")


CLIPPINGS = {
    "flat": dict(clipping="flat", max_grad_norm=0.5),
    "per_layer": dict(clipping="per_layer", max_grad_norm=0.2),  # a list of one per parameter, below
    "automatic": dict(clipping="automatic", max_grad_norm=1.0, gamma=0.01),
    "adaptive": dict(clipping="adaptive", max_grad_norm=0.5, unclipped_num_std=1.0, expected_batch_size=N),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clipping", list(CLIPPINGS))
@pytest.mark.parametrize("tokens,width", [(2, 16), (8, 4)], ids=["ghost-norms", "instantiated-norms"])
def test_dropped_units_contribute_zero_and_the_others_are_unaffected(mode, clipping, tokens, width):
    options = dict(CLIPPINGS[clipping])
    model = build(mode, width)
    if clipping == "per_layer":
        options["max_grad_norm"] = [options["max_grad_norm"]] * len(list(model.parameters()))
    inputs = batch(tokens)
    want = reference_update(copy.deepcopy(model), inputs, KEPT, clipping=options["clipping"],
                            max_grad_norm=options["max_grad_norm"], gamma=options.get("gamma", 0.01))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        got, _ = dp_step(model, mode, inputs, **options)
    assert_updates_equal(got, want, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_dropped_units_contribute_zero(mode):
    model = build(mode, 16, torch.bfloat16)
    inputs = batch(2, torch.bfloat16)
    want = reference_update(copy.deepcopy(model), inputs, KEPT, max_grad_norm=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        got, _ = dp_step(model, mode, inputs, max_grad_norm=0.5)
    assert_updates_equal(got, want, rtol=3e-2)  # bf16 forward and backward; the sums are float32


@pytest.mark.parametrize("mode", MODES)
def test_the_step_equals_the_step_without_the_dropped_units(mode):
    """The same optimizer arithmetic on the batch of the kept units alone gives the same update."""
    model = build(mode, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        got, _ = dp_step(copy.deepcopy(model), mode, batch(2), max_grad_norm=0.5)
    kept = tuple(t[KEPT] for t in batch(2))
    alone, _ = dp_step(copy.deepcopy(model), mode, kept, max_grad_norm=0.5)
    assert_updates_equal(got, alone, rtol=1e-5)


def test_privacy_units_drop_the_whole_unit():
    """With rows grouped into units, a unit with one bad row is dropped whole; the others are kept."""
    model = build("bk", 16)
    inputs = batch(2)
    units = torch.tensor([0, 0, 1, 1, 2, 2])  # INF_UNIT = row 1 (unit 0), LOG0_UNIT = row 4 (unit 2)
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    hooks.set_privacy_units(units)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0, max_grad_norm=0.5,
                      loss_reduction="sum", clipping_stats="raw")
    reference = copy.deepcopy(model)
    ids, x, targets = inputs
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        per_sample_loss(model(ids, x), targets).sum().backward()
        opt.step()
    hooks.cleanup()
    assert opt.last_clipping_stats["units"] == 3 and opt.last_clipping_stats["nonfinite_units"] == 2
    # unit 1 (rows 2, 3) alone: its gradient is the sum of its rows' gradients, clipped once
    reference.zero_grad(set_to_none=True)
    per_sample_loss(reference(ids[2:4], x[2:4]), targets[2:4]).sum().backward()
    g = {n: p.grad.double() for n, p in reference.named_parameters()}
    norm = sum(v.pow(2).sum() for v in g.values()).sqrt() * (1 + ROUNDING_MARGIN)
    factor = (0.5 / (norm + 1e-6)).clamp(max=1)
    got = {n: before[n] - p.detach().double() for n, p in model.named_parameters()}
    assert_updates_equal(got, {n: factor * v for n, v in g.items()}, rtol=1e-4)


def test_raw_statistics_count_the_dropped_units_and_are_not_covered():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        _, opt = dp_step(build("bk", 16), "bk", batch(2), max_grad_norm=0.5, clipping_stats="raw")
    stats = opt.last_clipping_stats
    assert stats["covered_by_epsilon"] is False
    assert stats["units"] == N and stats["nonfinite_units"] == 2
    assert all(torch.isfinite(torch.tensor(v)) for v in stats["norm_quantiles"].values())  # of the finite norms
    assert 0 <= stats["clipped_fraction"] <= (N - 2) / N  # a dropped unit is not "clipped"
    assert opt.clipping_logs()["raw_nonfinite_units"] == 2


def test_private_statistics_release_the_count_noised():
    """The dropped count is released with the count's noise (std 2 sigma_b around the truth), at no
    extra cost: the plan's gradient noise is the one private statistics already have."""
    model = build("hooks", 16)
    inputs = batch(2)
    sigma_b = 1.5
    hooks = GradSampleHooks(model, grad_sample_mode="hooks", loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), hooks=hooks, noise_multiplier=1.0, max_grad_norm=0.5,
                      expected_batch_size=N, loss_reduction="sum", clipping_stats="private", unclipped_num_std=sigma_b,
                      noise_generator=NoiseGenerator(seed=5))
    reported = []
    ids, x, targets = inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        for _ in range(400):
            per_sample_loss(model(ids, x), targets).sum().backward()
            opt.step()
            opt.zero_grad()
            reported.append(opt.last_clipping_stats["nonfinite_units"])
    hooks.cleanup()
    assert opt.last_clipping_stats["covered_by_epsilon"] is True
    values = torch.tensor(reported, dtype=torch.float64)
    # reports are clamped at 0; the truth (2) is 0.67 std above it, so compare the median and upper quantiles
    assert len(set(reported)) > 300  # noised, not the exact count
    assert abs(float(values.median()) - 2.0) < 0.5
    assert abs(float(values.quantile(0.84)) - (2.0 + 2 * sigma_b)) < 0.6
    raised = (1.0 ** -2 - (2 * sigma_b) ** -2) ** -0.5
    assert opt.plan.gradient_noise_multiplier == pytest.approx(raised, rel=1e-12)


def test_adaptive_count_ignores_dropped_units():
    """The unclipped count gets ``+-1/2`` from each finite unit only (a dropped unit's vector is ``(0, 1/2)``)."""
    model = build("bk", 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        _, opt = dp_step(model, "bk", batch(2), clipping="adaptive", max_grad_norm=1e6, unclipped_num_std=1e-9,
                         expected_batch_size=N)
    # every finite unit is within the huge bound: count 4 * 1/2, fraction 2 / 6 + 1/2
    assert opt.last_unclipped_fraction == pytest.approx((N - 2) / 2 / N + 0.5, abs=1e-6)


def test_warning_is_shown_once_and_names_no_unit():
    model = build("bk", 16)
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.0, max_grad_norm=0.5,
                      loss_reduction="sum")
    ids, x, targets = batch(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            per_sample_loss(model(ids, x), targets).sum().backward()
            opt.step()
            opt.zero_grad()
    hooks.cleanup()
    shown = [w for w in caught if issubclass(w.category, NonFiniteGradientWarning)]
    assert len(shown) == 1
    text = str(shown[0].message)
    assert re.search(r"\d", text.replace("log(0)", "")) is None  # no index, no count
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_finite_batches_are_unchanged_and_do_not_warn():
    model = build("bk", 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteGradientWarning)
        _, opt = dp_step(model, "bk", batch(2, bad=False), max_grad_norm=0.5, clipping_stats="raw")
    assert opt.last_clipping_stats["nonfinite_units"] == 0


def test_a_mid_step_checkpoint_keeps_the_dropped_count():
    model = build("hooks", 16)
    hooks = GradSampleHooks(model, grad_sample_mode="hooks", loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.0, max_grad_norm=0.5,
                      loss_reduction="sum", clipping_stats="raw")
    ids, x, targets = batch(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        per_sample_loss(model(ids, x), targets).sum().backward()
    opt.signal_skip_step()
    opt.step()  # a virtual step: the clipped sum and the count are held
    state = opt.state_dict()
    assert state["dp"]["nonfinite_count"] == 2
    opt.load_state_dict(state)
    assert opt._nonfinite_count == 2
    hooks.cleanup()
