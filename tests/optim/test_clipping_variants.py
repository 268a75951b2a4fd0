"""Clipping functions and the automatic / adaptive modes: bounds, noise, accounting, convergence."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.data import BatchMemoryManager
from dptorch.data.poisson import DPDataLoader
from dptorch.grad_sample import GradSampleHooks
from dptorch.noise import NoiseGenerator
from dptorch.optim import AdaClipDPOptimizer, AdaptiveClipping, DPOptimizer
from dptorch.clipping.adaptive import composed_noise_multiplier, gradient_noise_multiplier
from dptorch.clipping.factors import automatic_factors, clip_factors
from dptorch.plan import PrivacyPlan

# Norms over 16 orders of magnitude, and exactly at / next to a threshold of 1.
NORMS = torch.cat([torch.logspace(-8, 8, 400), torch.tensor([0.0, 1.0, 1 - 1e-7, 1 + 1e-7])])


# ---------------------------------------------------------------------------- clipping functions


@pytest.mark.parametrize("bound", [1e-3, 1.0, 37.5])
def test_flat_factor_bounds_every_contribution_and_is_identity_below_the_bound(bound):
    norms = NORMS * bound
    factors = clip_factors(norms, bound)
    assert factors.dtype == torch.float32 and (factors <= 1).all() and (factors > 0).all()
    assert (norms.double() * factors.double() <= bound).all()
    below = norms < bound * (1 - 1e-4)
    assert (factors[below] >= 1 - 1e-4).all() and (factors[below & (norms < bound * 0.5)] == 1).all()
    above = norms > bound * 2
    # at the bound up to the 1e-6 stability term of the denominator
    torch.testing.assert_close((norms * factors)[above], torch.full_like(norms[above], bound), rtol=1e-3, atol=0)


@pytest.mark.parametrize("gamma", [1e-4, 0.01, 1.0])
def test_automatic_factor_keeps_every_contribution_below_one(gamma):
    factors = automatic_factors(NORMS, gamma)
    contribution = NORMS.double() * factors.double()
    assert factors.dtype == torch.float32 and (contribution < 1).all()
    torch.testing.assert_close(factors.double(), 1 / (NORMS.double() + gamma), rtol=3e-5, atol=0)  # 2^-16 margin
    # Large gradients are normalised to ~1, small ones scaled by ~1/gamma (AUTO-S); larger in, larger out.
    assert contribution[399] > 1 - 1e-4 and (contribution[:400].diff() >= -1e-6).all()
    with pytest.raises(ValueError, match="gamma"):
        automatic_factors(NORMS, 0.0)


def linear_setup(norms, *, seed=0):
    """A Linear(d, 1) with the loss -<w, x>: each sample's gradient is -x, of norm ||x|| (chosen)."""
    g = torch.Generator().manual_seed(seed)
    d = 8
    x = torch.randn(len(norms), d, generator=g)
    x = x / x.norm(dim=1, keepdim=True) * torch.as_tensor(norms, dtype=torch.float32).view(-1, 1)
    model = nn.Linear(d, 1, bias=False)
    nn.init.zeros_(model.weight)
    return model, x


def test_automatic_clipping_each_sample_moves_the_model_by_g_over_norm_plus_gamma():
    model, x = linear_setup([1e-3, 0.5, 3.0, 1e4])
    hooks = GradSampleHooks(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0, max_grad_norm=1.0,
                      loss_reduction="sum", clipping="automatic", gamma=0.05)
    for row in x:
        before = model.weight.detach().clone()
        (-model(row[None]).sum()).backward()
        opt.step()
        opt.zero_grad()
        moved = model.weight.detach() - before
        assert moved.norm() < 1
        torch.testing.assert_close(moved[0], row / (row.norm() + 0.05), rtol=3e-5, atol=1e-7)
    assert opt.plan.sensitivity == 1.0 and opt.plan.report(1e-5)["gamma"] == 0.05
    hooks.cleanup()


def zero_gradient_noise_std(clipping, *, C=1.0, sigma=2.0, **options):
    """Std of p.grad when every per-sample gradient is zero: the noise alone."""
    model = nn.Linear(60, 50)
    hooks = GradSampleHooks(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), hooks=hooks, noise_multiplier=sigma, max_grad_norm=C,
                      loss_reduction="sum", clipping=clipping, noise_generator=NoiseGenerator(seed=3),
                      expected_batch_size=8, **options)
    (model(torch.randn(8, 60)) * 0).sum().backward()
    std = opt.noise_std  # adaptive clipping moves the bound at the step
    opt.step()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    hooks.cleanup()
    return float(grads.std()), std, opt


def test_automatic_clipping_noise_std_is_sigma_not_sigma_times_c():
    with pytest.warns(UserWarning, match="not used by automatic clipping"):
        measured, std, _ = zero_gradient_noise_std("automatic", C=0.25, sigma=2.0)
    assert std == 2.0
    assert measured == pytest.approx(2.0, rel=0.04)  # 3050 draws
    flat, flat_std, _ = zero_gradient_noise_std("flat", C=0.25, sigma=2.0)
    assert flat_std == 0.5 and flat == pytest.approx(0.5, rel=0.04)


# ---------------------------------------------------------------------------- adaptive: accounting


def test_gradient_noise_multiplier_is_the_composed_formula_and_impossible_settings_are_refused():
    sigma, sigma_b = 1.1, 3.2
    expected = (sigma**-2 - (2 * sigma_b) ** -2) ** -0.5
    assert gradient_noise_multiplier(sigma, sigma_b) == pytest.approx(expected, rel=1e-12)
    assert composed_noise_multiplier(expected, sigma_b) == pytest.approx(sigma, rel=1e-12)
    assert gradient_noise_multiplier(sigma, None) == sigma and gradient_noise_multiplier(0.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="noise_multiplier must be smaller than 2 \* unclipped_num_std: .* needs unclipped_num_std > noise_multiplier / 2"):
        gradient_noise_multiplier(2.0, 1.0)  # 2 sigma_b == sigma: the count would take the whole budget
    with pytest.raises(ValueError, match="unclipped_num_std"):  # Opacus' failing case: batch 8, sigma_b = 8/20
        PrivacyPlan(noise_multiplier=1.0, max_grad_norm=1.0, clipping="adaptive", expected_batch_size=8, accountant=None)


def test_adaptive_accounting_records_the_stated_sigma_and_the_gradient_gets_the_raised_one():
    measured, std, opt = zero_gradient_noise_std("adaptive", C=0.5, sigma=2.0, unclipped_num_std=2.0)
    raised = (2.0**-2 - 4.0**-2) ** -0.5
    assert opt.noise_multiplier == 2.0 and opt.plan.gradient_noise_multiplier == pytest.approx(raised)
    assert std == pytest.approx(raised * 0.5) and measured == pytest.approx(raised * 0.5, rel=0.04)

    def run(clipping, **options):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        data = DataLoader(TensorDataset(torch.randn(200, 4), torch.randn(200, 2)), batch_size=40)
        engine = PrivacyEngine()
        model, optimizer, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                       data_loader=data, noise_multiplier=1.3, max_grad_norm=1.0,
                                                       clipping=clipping, **options)
        for x, y in loader:
            ((model(x) - y) ** 2).sum(1).mean().backward()  # loss_reduction="mean" (the default)
            optimizer.step()
            optimizer.zero_grad()
        return engine

    adaptive, flat = run("adaptive", unclipped_num_std=4.0), run("flat")
    assert adaptive.plan.accountant.history == [[1.3, 0.2, 5]]  # one Gaussian of the stated sigma per step
    assert adaptive.plan.steps == flat.plan.steps == 5
    assert adaptive.get_epsilon(1e-5) == pytest.approx(flat.get_epsilon(1e-5), rel=1e-12)
    report = adaptive.privacy_report(1e-5)
    assert report["noise_multiplier"] == 1.3 and report["unclipped_num_std"] == 4.0
    assert report["gradient_noise_multiplier"] == pytest.approx((1.3**-2 - 8.0**-2) ** -0.5)
    assert report["adaptive_clipping"]["initial_max_grad_norm"] == 1.0 and report["max_grad_norm"] != 1.0


# ---------------------------------------------------------------------------- adaptive: behaviour


@pytest.mark.parametrize("target", [0.5, 0.9])
def test_adaptive_bound_converges_to_the_target_quantile_of_a_synthetic_norm_distribution(target):
    g = torch.Generator().manual_seed(1)
    norms = torch.exp(torch.randn(4000, generator=g) * 0.8 + 1.0)  # log-normal, median e
    truth = float(torch.quantile(norms.double(), target))
    model, x = linear_setup(norms)
    hooks = GradSampleHooks(model, loss_reduction="sum")
    opt = AdaClipDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), hooks=hooks, noise_multiplier=1.0, max_grad_norm=0.05,
        expected_batch_size=256, target_unclipped_quantile=target, clipbound_learning_rate=0.2, max_clipbound=1e3,
        min_clipbound=1e-3, unclipped_num_std=256 / 20, loss_reduction="sum", noise_generator=NoiseGenerator(seed=2),
    )
    trajectory = []
    for step in range(300):
        batch = x[torch.randint(0, len(x), (256,), generator=g)]
        (-model(batch).sum()).backward()
        opt.step()
        opt.zero_grad()
        trajectory.append(float(opt.max_grad_norm))
    settled = sum(trajectory[-100:]) / 100
    assert trajectory[0] < trajectory[30] < truth * 1.5  # climbs geometrically from 0.05
    assert settled == pytest.approx(truth, rel=0.08)
    hooks.cleanup()


def adaptive_trajectory(mode, *, physical=None, steps=6):
    """C after every logical step of an adaptive run, with fixed sampling and noise seeds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    data = TensorDataset(torch.randn(240, 6) * 3, torch.randn(240, 3))
    loader = DPDataLoader(data, sample_rate=0.25, steps=steps, seed=5)
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=0.5, clipping="adaptive", clipbound_learning_rate=0.5, grad_sample_mode=mode,
        noise_generator=NoiseGenerator(seed=7),
    )
    bounds = []
    if physical is None:
        batches = loader
        manager = None
    else:
        manager = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=opt)
        batches = manager.__enter__()
    for x, y in batches:
        ((model(x) - y) ** 2).sum(1).mean().backward()
        opt.step()
        if physical is None or not opt._last_step_skipped:
            bounds.append(float(opt.max_grad_norm))
        opt.zero_grad()
    if manager is not None:
        manager.__exit__(None, None, None)
    engine.detach()
    return bounds, engine


def test_adaptive_clipping_gives_one_trajectory_in_hooks_bk_ghost_and_with_virtual_steps():
    reference, engine = adaptive_trajectory("hooks")
    assert len(reference) == 6 and len(set(reference)) == 6 and engine.plan.steps == 6
    for mode in ("bk", "ghost"):
        torch.testing.assert_close(adaptive_trajectory(mode)[0], reference, rtol=1e-5, atol=0)
    # Physical batches of 16 (about 4 per logical batch of 60): the count is accumulated over them
    # and noised once per logical step, so the noise stream and the bounds are the same.
    split, engine = adaptive_trajectory("hooks", physical=16)
    torch.testing.assert_close(split, reference, rtol=1e-5, atol=0)
    assert engine.plan.steps == 6


def test_adaptive_bound_survives_a_checkpoint_and_opacus_construction_is_accepted(tmp_path):
    bounds, engine = adaptive_trajectory("hooks", steps=3)
    state = engine.plan.state_dict()
    assert state["max_grad_norm"] == bounds[-1]
    fresh = PrivacyPlan(noise_multiplier=1.0, max_grad_norm=0.5, clipping="adaptive", sample_rate=0.25, num_units=240,
                        steps_per_epoch=3, accountant="pld")
    fresh.load_state_dict(state)
    assert fresh.max_grad_norm == bounds[-1] and fresh.initial_max_grad_norm == 0.5

    model = nn.Linear(3, 2)
    hooks = GradSampleHooks(model)
    opt = AdaClipDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=1.0,
                             max_grad_norm=1.0, expected_batch_size=64, target_unclipped_quantile=0.7,
                             clipbound_learning_rate=0.1, max_clipbound=5.0, min_clipbound=0.1, unclipped_num_std=3.2,
                             generator=torch.Generator().manual_seed(0))
    assert opt.clipping == "adaptive" and opt.plan.adaptive == AdaptiveClipping(0.7, 0.1, 5.0, 0.1)
    hooks.cleanup()
    with pytest.raises(ValueError, match="noise_multiplier must be smaller than 2 \* unclipped_num_std: .* needs unclipped_num_std > noise_multiplier / 2"):
        AdaClipDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=GradSampleHooks(nn.Linear(3, 2)),
                           noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8, unclipped_num_std=0.4)
    with pytest.raises(ValueError, match="outside"):
        AdaptiveClipping(max_clipbound=2.0).check_initial(3.0)


def test_options_of_another_clipping_mode_are_refused():
    model = nn.Linear(3, 2)
    data = DataLoader(TensorDataset(torch.randn(20, 3)), batch_size=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for mode, options, match in [("flat", {"gamma": 0.1}, "gamma"), ("automatic", {"target_unclipped_quantile": 0.3}, "adaptive"),
                                 ("flat", {"unclipped_num_std": 2.0}, "unclipped_num_std"),
                                 ("automatic", {"clipping_stats": "private"}, "automatic clipping has no bound"),
                                 ("flat", {"clipping_stats": "yes"}, "clipping_stats")]:
        with pytest.raises(ValueError, match=match):
            PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=data, noise_multiplier=1.0,
                                         max_grad_norm=1.0, clipping=mode, **options)
    with pytest.raises(ValueError, match="one max_grad_norm"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=data, noise_multiplier=1.0,
                                     max_grad_norm=[1.0, 1.0], clipping="adaptive")
    assert not any(m._forward_hooks for m in model.modules())  # refused before anything was attached


# ---------------------------------------------------------------------------- clipping statistics


def stats_run(clipping_stats, clipping="flat", **options):
    model, x = linear_setup([0.5, 1.5, 2.0, 4.0, 0.25, 3.0, 1.0 - 1e-3, 8.0])
    hooks = GradSampleHooks(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=1.0, max_grad_norm=1.0,
                      loss_reduction="sum", expected_batch_size=8, clipping=clipping, clipping_stats=clipping_stats,
                      noise_generator=NoiseGenerator(seed=0), **options)
    for half in (x[:4], x[4:]):  # two backward passes, one logical step
        (-model(half).sum()).backward()
    opt.step()
    hooks.cleanup()
    return opt


def test_clipping_statistics_are_off_by_default_raw_when_asked_and_flagged_as_not_covered():
    default = stats_run(None)
    assert default.last_clipping_stats is None and default.clipping_logs() == {}
    assert "clipping_stats" not in default.plan.report(1e-5) and default.noise_std == 1.0
    raw = stats_run("raw")
    stats = raw.last_clipping_stats
    assert stats["covered_by_epsilon"] is False and stats["units"] == 8 and stats["max_grad_norm"] == 1.0
    assert stats["clipped_fraction"] == 5 / 8
    norms = torch.tensor([0.5, 1.5, 2.0, 4.0, 0.25, 3.0, 1.0 - 1e-3, 8.0], dtype=torch.float64)
    assert stats["norm_quantiles"]["p50"] == pytest.approx(float(torch.quantile(norms, 0.5)), rel=1e-5)
    assert stats["norm_quantiles"]["max"] == pytest.approx(8.0, rel=1e-5)
    assert raw.noise_std == 1.0  # raw statistics cost nothing: they are not private
    assert raw.plan.report(1e-5)["clipping_stats"] == "raw (not covered by epsilon)"
    assert set(raw.clipping_logs()) == {"raw_units", "raw_clipped_fraction", "raw_norm_p10", "raw_norm_p50",
                                        "raw_norm_p90", "raw_norm_max", "raw_nonfinite_units"}
    assert stats["nonfinite_units"] == 0
    automatic = stats_run("raw", clipping="automatic").last_clipping_stats
    assert automatic["clipped_fraction"] is None and automatic["units"] == 8


def test_private_clipping_statistics_are_noised_and_paid_for_by_the_gradient_noise():
    with pytest.raises(ValueError, match="noise_multiplier must be smaller than 2 \* unclipped_num_std: .* needs unclipped_num_std > noise_multiplier / 2"):
        stats_run("private")  # default sigma_b = 8 / 20: too little noise to fit in sigma = 1
    private = stats_run("private", unclipped_num_std=2.0)
    stats = private.last_clipping_stats
    assert stats["covered_by_epsilon"] is True
    assert set(stats) == {"covered_by_epsilon", "clipped_fraction", "nonfinite_units", "max_grad_norm"}
    assert stats["nonfinite_units"] >= 0  # the noised count of dropped units (none here; clamped at 0)
    assert 0 <= stats["clipped_fraction"] <= 1 and stats["clipped_fraction"] != 5 / 8
    assert private.noise_multiplier == 1.0
    assert private.noise_std == pytest.approx((1 - 4.0**-2) ** -0.5)  # raised so that both compose to sigma = 1
    assert private.clipping_logs() == {"clipped_fraction": stats["clipped_fraction"],
                                       "nonfinite_units": stats["nonfinite_units"]}
