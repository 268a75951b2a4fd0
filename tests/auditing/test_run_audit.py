"""The audit of a real run: gradient canaries inside make_private's steps, and both bounds on their scores.

Checked as a tool should be: with noise 0 the audited bound is large; with clipping switched off
(a test-only switch: monkeypatch) it exceeds the claim; a correct run audits below its claim; the
canaries' contribution to each step is exactly known (C per sampled canary, once) and a run that does
not ask for canaries is unchanged.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.auditing import audit_run
from dptorch.optim.canaries import CanaryError


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 2))  # 33,538 trainable elements


def _loader(n=256, batch=128, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 128, generator=generator), torch.randint(0, 2, (n,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def _train(sigma, steps=10, canaries=1000, seed=0, **kwargs):
    model = _model(seed)
    engine = PrivacyEngine()
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), data_loader=_loader(seed=seed),
        noise_multiplier=sigma, max_grad_norm=1.0, audit_canaries=canaries, audit_seed=seed,
        noise_generator=torch.Generator().manual_seed(seed + 1), **kwargs)
    taken = 0
    while taken < steps:
        for x, y in loader:
            nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            taken += 1
            if taken == steps:
                break
    return engine


def test_with_noise_zero_the_audited_bound_is_large(one_thread):
    with pytest.warns(UserWarning, match="noise_multiplier=0"):
        engine = _train(0.0)
    audit = audit_run(engine, delta=1e-5)
    assert audit.claimed_epsilon == float("inf") and audit.step == 10 and audit.num_canaries == 1000
    # (nearly) every guess right: about the most 1000 canaries can show at 95% (Steinke: 3.6 for 200 of 200)
    best = audit.details["steinke"]
    assert best["num_guesses"] >= 200 and best["num_correct"] >= best["num_guesses"] - 1
    assert audit.steinke_epsilon > 3.5 and audit.fdp_epsilon > 5.0


def test_a_correct_run_audits_below_its_claim_and_f_dp_is_the_tighter_bound(one_thread):
    engine = _train(2.0)
    audit = audit_run(engine, delta=1e-5)
    assert audit.claimed_epsilon == pytest.approx(3.96, abs=0.02)
    assert audit.consistent and 0 < audit.steinke_epsilon < audit.fdp_epsilon < audit.claimed_epsilon
    assert 400 < audit.num_included < 600


def test_with_clipping_switched_off_the_audit_exceeds_the_claim(monkeypatch, one_thread):
    # Test-only switch: the optimizer's clip factors become 1 (every unit, canaries included, passes unclipped;
    # a canary's raw gradient is 10 C).
    monkeypatch.setattr("dptorch.optim.optimizer.clip_factors",
                        lambda norms, bound: torch.ones_like(norms, dtype=torch.float32))
    engine = _train(2.0)
    audit = audit_run(engine, delta=1e-5)
    assert audit.claimed_epsilon == pytest.approx(3.96, abs=0.02)
    assert not audit.consistent and audit.fdp_epsilon > audit.claimed_epsilon + 1
    assert audit.steinke_epsilon > 3.5


def _first_step_gradient(canaries):
    """The privatised gradient of the first step (lr 0), and the engine."""
    model = _model()
    engine = PrivacyEngine()
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=_loader(),
        noise_multiplier=1.0, max_grad_norm=1.0, noise_generator=torch.Generator().manual_seed(1),
        audit_canaries=canaries, audit_seed=0)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(module(x), y).backward()
    optimizer.step()
    return torch.cat([p.grad.reshape(-1) for p in optimizer.params]), engine


def test_each_sampled_canary_adds_exactly_c_once_and_the_noise_is_unchanged(one_thread):
    """Same seeds with and without canaries: the first step's gradients differ only at the coordinates of the
    canaries sampled at that step, by C / (q N) each (the plan's divisor); the scores read the noised step."""
    plain, without = _first_step_gradient(None)
    assert without.audit_canaries is None and without.optimizer.canaries is None
    audited, engine = _first_step_gradient(1000)
    canaries = engine.audit_canaries
    added = canaries.times_added.bool()
    assert added.any() and not (added & ~canaries.included).any() and canaries.steps == 1
    offsets = [sum(p.numel() for p in engine.optimizer.params[:index]) for index in range(len(engine.optimizer.params))]
    coordinates = torch.cat([local + offsets[index] for index, local, _ in canaries._blocks])
    order = torch.cat([canary for _, _, canary in canaries._blocks])
    expected = torch.zeros_like(plain)
    strength = float(engine.optimizer.unit_factors(torch.tensor([10.0])) * 10.0)  # raw 10 C clipped: C (1 - 2^-16)
    expected[coordinates] = added[order].float() * strength / engine.plan.divisor  # once per sampled canary
    torch.testing.assert_close(audited - plain, expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(canaries.scores[order], (audited[coordinates] * engine.plan.divisor).double(),
                               rtol=1e-6, atol=1e-6)


def test_random_direction_canaries_audit_the_same_run(one_thread):
    with pytest.warns(UserWarning, match="noise_multiplier=0"):
        engine = _train(0.0, canaries=200, audit_canary_kind="random")
    audit = audit_run(engine, delta=1e-5)
    assert engine.audit_canaries.kind == "random" and audit.details["fdp"]["num_correct"] >= 95
    assert audit.fdp_epsilon > 3.0


@pytest.mark.parametrize("kwargs, problem", [
    (dict(clipping="per_layer", max_grad_norm=[1.0] * 4), "per-layer and adaptive clipping"),
    (dict(clipping="adaptive"), "per-layer and adaptive clipping"),
    (dict(clipping_stats="private"), "released count"),
    (dict(poisson_sampling=False), "not Poisson-sampled"),
])
def test_runs_the_audit_cannot_cover_are_refused_before_any_step(kwargs, problem):
    model = _model()
    options = dict(noise_multiplier=1.0, max_grad_norm=1.0)
    options.update(kwargs)
    with pytest.raises(CanaryError, match=problem):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=_loader(), audit_canaries=100, **options)
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


class _PartitionedWriter:
    """A gradient writer of another layout (as DeepSpeed's partitions and tensor-parallel slices are)."""

    def keep(self, optimizer, hooks, factors, dropped=None):
        return factors

    def write(self, optimizer, params):
        raise AssertionError("never reached: the canaries refuse the step first")


def test_a_gradient_writer_other_than_whole_parameters_or_fsdp2_shards_is_refused_at_attach_and_at_the_step():
    from dptorch.optim.canaries import GradientCanaries

    model = _model()
    engine = PrivacyEngine()
    _, optimizer, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                               data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0)
    optimizer.use_gradient_writer(_PartitionedWriter())
    with pytest.raises(CanaryError, match="_PartitionedWriter.*whole parameters or FSDP2"):
        GradientCanaries.attach(optimizer, 100)
    model = _model()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=_loader(),
        noise_multiplier=1.0, max_grad_norm=1.0, audit_canaries=100)
    optimizer.use_gradient_writer(_PartitionedWriter())  # swapped after the canaries were placed
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(CanaryError, match="_PartitionedWriter"):
        optimizer.step()


def test_audit_run_refuses_a_delta_above_one_over_n_plus_m_and_a_run_without_canaries(one_thread):
    engine = _train(1.0, steps=1, canaries=100)
    with pytest.raises(ValueError, match=r"1 / \(N \+ m\)"):
        audit_run(engine, delta=1 / 300)  # N = 256, m = 100
    with pytest.raises(ValueError, match="no audit canaries"):
        audit_run(PrivacyEngine(), delta=1e-5)


def test_the_canaries_stream_is_not_the_noise_stream_of_the_same_seed():
    """audit_seed equal to noise_seed: the canaries' draws must not be the noise generator's (a canary sum that is a
    function of the noise would make the noise non-Gaussian for the data's units)."""
    from dptorch.optim.canaries import GradientCanaries

    params = [nn.Parameter(torch.zeros(4000))]
    canaries = GradientCanaries(params, 1000, sample_rate=0.5, seed=7)
    same_seed = torch.rand(1000, generator=torch.Generator().manual_seed(7)) < 0.5
    assert not torch.equal(canaries.included, same_seed)
    assert 400 < int(canaries.included.sum()) < 600
