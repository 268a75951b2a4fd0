"""Static-shape batches in a private run: padding rows contribute exactly nothing in every mode, every draw
is accounted by its own event, a resumed run continues the accounting exactly, and what the accounting
does not cover is refused before any step."""

import warnings

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant
from torch import nn
from torch.utils.data import TensorDataset

from dptorch import BatchMemoryManager, PrivacyEngine
from dptorch.accounting.pld import automatic_discretization_interval
from dptorch.accounting.sampled_gaussian_rdp import DEFAULT_ORDERS
from dptorch.clipping.factors import DEFAULT_GAMMA, automatic_factors, clip_factors, per_layer_thresholds
from dptorch.data import FixedSizeDataLoader, TruncatedPoissonBatchSampler, TruncatedPoissonDataLoader
from dptorch.data.poisson import PoissonBatchSampler
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.plan import SamplingMismatchError

N, Q, B = 20, 0.3, 6  # expected 6 real rows, at most 6 kept: truncated about half the time
MODES = ["hooks", "functorch", "bk", "ghost", "ew"]
DELTA = 1e-5


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 2, (N,), generator=g))


def network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))


def seed_whose_first_draw(predicate, q=Q):
    """A sampler seed whose first (truncated) draw satisfies ``predicate``."""
    return next(s for s in range(10_000)
                if predicate(TruncatedPoissonBatchSampler(N, q, max_batch_size=B, seed=s).draw()[1]))


def private(loader, engine=None, model=None, **options):
    engine = engine or PrivacyEngine()
    model = model or network()
    settings = dict(noise_multiplier=1.0, max_grad_norm=1.0, loss_reduction="sum", wrap_model=False)
    settings.update(options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0: clipping only
        _hooks, optimizer, dp_loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader, **settings)
    return engine, model, optimizer, dp_loader


def train_step(model, optimizer, x, y, reduction="sum"):
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
    optimizer.step()


def expected_clipped_sum(rows, clipping, bound):
    """The clipped sum of the real rows from each row's gradient alone (a batch of one)."""
    x, y = dataset().tensors
    model = network()
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in rows:
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum"), params)
        norms = torch.stack([g.norm() for g in grads])
        if clipping == "per_layer":
            limits = per_layer_thresholds(params, bound)
            factors = [clip_factors(n.reshape(1), limits[p])[0] for n, p in zip(norms, params)]
        elif clipping == "automatic":
            factors = [automatic_factors(norms.norm().reshape(1), DEFAULT_GAMMA)[0]] * len(params)
        else:
            factors = [clip_factors(norms.norm().reshape(1), bound)[0]] * len(params)
        total = [t + f * g for t, f, g in zip(total, factors, grads)]
    return total


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
@pytest.mark.parametrize("mode", MODES)
def test_padding_rows_that_copy_a_real_row_add_nothing_in_every_mode(mode, clipping):
    seed = seed_whose_first_draw(lambda rows: 0 in rows and 1 < len(rows) < B)  # row 0 real and padding
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=seed)
    engine, model, optimizer, dp_loader = private(loader, noise_multiplier=0.0, max_grad_norm=0.1, clipping=clipping,
                                                  grad_sample_mode=mode)
    x, y = next(iter(dp_loader))
    real = engine.plan.draws.sizes[-1]
    rows = TruncatedPoissonBatchSampler(N, Q, max_batch_size=B, seed=seed).draw()[1]
    assert x.shape[0] == B and real == len(rows)
    assert torch.equal(x[real:], dataset().tensors[0][[0] * (B - real)])  # the padding: copies of row 0
    train_step(model, optimizer, x, y)
    for grad, expected in zip([p.grad for p in model.parameters()], expected_clipped_sum(rows, clipping, 0.1)):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    engine.detach()


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_of_padding_only_adds_exactly_zero(mode):
    seed = seed_whose_first_draw(lambda rows: not rows, q=0.05)
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=0.05, max_batch_size=B, seed=seed)
    engine, model, optimizer, dp_loader = private(loader, noise_multiplier=0.0, grad_sample_mode=mode)
    x, y = next(iter(dp_loader))
    assert x.shape[0] == B and engine.plan.draws.sizes[-1] == 0
    train_step(model, optimizer, x, y)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    engine.detach()


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_mean_reduction_divides_the_real_rows_by_the_expected_batch_size(mode):
    seed = seed_whose_first_draw(lambda rows: 0 < len(rows) < B)
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=seed)
    engine, model, optimizer, dp_loader = private(loader, noise_multiplier=0.0, max_grad_norm=0.1,
                                                  loss_reduction="mean", grad_sample_mode=mode)
    x, y = next(iter(dp_loader))
    train_step(model, optimizer, x, y, reduction="mean")  # the mean over all B rows, padding included
    rows = TruncatedPoissonBatchSampler(N, Q, max_batch_size=B, seed=seed).draw()[1]
    assert engine.plan.divisor == pytest.approx(Q * N)
    for grad, expected in zip([p.grad for p in model.parameters()], expected_clipped_sum(rows, "flat", 0.1)):
        torch.testing.assert_close(grad, expected / (Q * N), rtol=1e-5, atol=1e-8)
    engine.detach()


def test_padding_rows_are_not_counted_in_clipping_statistics():
    seed = seed_whose_first_draw(lambda rows: 0 < len(rows) < B - 1)
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=seed)
    engine, model, optimizer, dp_loader = private(loader, max_grad_norm=0.1, clipping_stats="raw")
    x, y = next(iter(dp_loader))
    train_step(model, optimizer, x, y)
    real = engine.plan.draws.sizes[-1] if engine.plan.draws.sizes else None
    rows = TruncatedPoissonBatchSampler(N, Q, max_batch_size=B, seed=seed).draw()[1]
    assert optimizer.last_clipping_stats["units"] == len(rows) and real is None  # the ledger was reset by the step
    engine.detach()

    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=seed)
    engine, model, optimizer, dp_loader = private(loader, max_grad_norm=1e3, clipping_stats="private",
                                                  unclipped_num_std=5.0)
    x, y = next(iter(dp_loader))
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    assert float(optimizer._unclipped_count) == 0.5 * len(rows)  # every real row unclipped: +1/2 each, padding 0
    engine.detach()


def test_a_padded_batch_keeps_one_shape_for_200_steps_and_so_does_a_fixed_size_one():
    seed = 11
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=seed)
    engine, _, _, dp_loader = private(loader)
    shapes = set()
    while len(engine.plan.draws.sizes) < 200:
        for x, y in dp_loader:
            shapes.add((tuple(x.shape), tuple(y.shape)))
            if len(engine.plan.draws.sizes) == 200:
                break
    assert shapes == {((B, 5), (B,))}
    poisson = PoissonBatchSampler(N, Q, seed=seed)
    drawn = [len(poisson.draw()[1]) for _ in range(200)]
    assert engine.plan.draws.sizes == [min(n, B) for n in drawn]  # the real rows: the Poisson draw, cut to B
    assert min(drawn) < B < max(drawn)  # both padded and truncated draws were there
    engine.detach()

    engine, _, _, dp_loader = private(FixedSizeDataLoader(dataset(), batch_size=4, seed=seed),
                                      engine=PrivacyEngine(accountant="rdp"))
    shapes = set()
    while len(engine.plan.draws.sizes) < 200:
        shapes |= {tuple(x.shape) for x, _ in dp_loader}
    assert shapes == {(4, 5)}
    engine.detach()


def test_a_fixed_size_batch_splits_into_physical_batches_of_one_shape_and_one_step():
    engine, model, optimizer, dp_loader = private(FixedSizeDataLoader(dataset(), batch_size=6, seed=2),
                                                  engine=PrivacyEngine(accountant="rdp"))
    with BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=2, optimizer=optimizer) as physical:
        shapes = set()
        for x, y in physical:
            shapes.add(tuple(x.shape))
            train_step(model, optimizer, x, y)
    assert shapes == {(2, 5)} and engine.plan.steps == len(dp_loader) == len(engine.accountant) == 3
    engine.detach()


def truncated_epsilon(sigma, steps, q=Q, batch=B):
    reference = pld_privacy_accountant.PLDAccountant(
        value_discretization_interval=automatic_discretization_interval(((sigma, q, steps),)))
    reference.compose(dp_event.TruncatedSubsampledGaussianDpEvent(N, q, batch, sigma), steps)
    return reference.get_epsilon(DELTA)


def fixed_size_epsilon(sigma, steps, size):
    reference = rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS), NeighboringRelation.REPLACE_ONE)
    reference.compose(dp_event.SampledWithoutReplacementDpEvent(N, size, dp_event.GaussianDpEvent(sigma / 2)), steps)
    return reference.get_epsilon(DELTA)


def test_every_draw_is_accounted_by_its_event_whatever_the_loop():
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=4)  # 3 draws an epoch
    engine, model, optimizer, dp_loader = private(loader)
    handed = 0
    for x, y in dp_loader:  # a loop that breaks early
        handed += 1
        train_step(model, optimizer, x, y)
        break
    for epoch in range(3):  # several epochs, one draw of each skipped without a backward pass
        for i, (x, y) in enumerate(dp_loader):
            handed += 1
            if i == 1:
                continue  # handed out, no backward: accounted with the next step
            train_step(model, optimizer, x, y)
    assert handed == 1 + 2 + 3 + 3 and engine.plan.steps == handed == len(engine.accountant)
    assert engine.get_epsilon(DELTA) == pytest.approx(truncated_epsilon(1.0, handed), rel=1e-7)
    assert engine.privacy_report(DELTA)["adjacency"] == "add or remove one unit"
    engine.detach()

    fixed = FixedSizeDataLoader(dataset(), batch_size=4, seed=4)  # 5 draws an epoch
    engine, model, optimizer, dp_loader = private(fixed, engine=PrivacyEngine(accountant="rdp"))
    for epoch in range(3):  # the second pass completes the interrupted epoch
        for i, (x, y) in enumerate(dp_loader):
            train_step(model, optimizer, x, y)
            if epoch == 0 and i == 2:
                break
    assert engine.plan.steps == 3 + 2 + 5 == len(engine.accountant)
    assert engine.get_epsilon(DELTA) == pytest.approx(fixed_size_epsilon(1.0, 10, 4), rel=1e-12)
    assert engine.privacy_report(DELTA)["adjacency"] == "replace one unit"
    engine.detach()


def run_steps(engine, model, optimizer, dp_loader, steps, train=train_step):
    """``steps`` steps of ``train(model, optimizer, x, y)`` across passes, no batch drawn past the last one."""
    taken = 0
    while taken < steps:
        for x, y in dp_loader:
            train(model, optimizer, x, y)
            taken += 1
            if taken == steps:
                return


def resumed_after(tmp_path, start, steps, train=train_step):
    """The run ``start()`` makes, trained ``steps`` steps, checkpointed, and loaded into a fresh ``start()``."""
    engine, model, optimizer, dp_loader = start()
    run_steps(engine, model, optimizer, dp_loader, steps, train)
    engine.save_checkpoint(tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=dp_loader)
    engine.detach()
    resumed = start()
    resumed[0].load_checkpoint(tmp_path / "run.pt", module=resumed[1], optimizer=resumed[2], data_loader=resumed[3])
    return resumed


def test_a_resumed_run_continues_the_accounting_and_the_draws_exactly(tmp_path):
    def start():
        torch.manual_seed(5)
        return private(TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=9))

    straight = start()
    run_steps(*straight, 5)
    resumed = resumed_after(tmp_path, start, 2)
    assert resumed[0].plan.steps == 2 and resumed[0].accountant.selection == straight[0].accountant.selection
    run_steps(*resumed, 3)
    assert resumed[0].get_epsilon(DELTA) == straight[0].get_epsilon(DELTA) == pytest.approx(
        truncated_epsilon(1.0, 5), rel=1e-7)
    for p, q in zip(resumed[1].parameters(), straight[1].parameters()):
        assert torch.equal(p, q)  # the same draws, the same noise
    resumed[0].detach(), straight[0].detach()

    other = private(TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B + 1, seed=9))
    with pytest.raises(ValueError, match="max_batch_size|selection"):
        other[0].load_checkpoint(tmp_path / "run.pt", module=other[1], optimizer=other[2], data_loader=other[3])
    opacus = {"module_state_dict": other[1].state_dict(),  # Opacus' layout: a history of Poisson steps
              "privacy_accountant_state_dict": {"mechanism": "pld", "history": [[1.0, Q, 4]]}}
    torch.save(opacus, tmp_path / "opacus.pt")
    with pytest.raises(ValueError, match="composed poisson batch selection"):
        other[0].load_checkpoint(tmp_path / "opacus.pt", module=other[1])
    assert other[0].plan.steps == 0 and len(other[0].accountant) == 0
    other[0].detach()


def test_make_private_with_epsilon_calibrates_for_the_selections_event():
    model = network()
    engine = PrivacyEngine()
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=1)
    engine.make_private_with_epsilon(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=loader, target_epsilon=4.0, target_delta=DELTA,
                                     max_grad_norm=1.0, steps=30)
    sigma = engine.noise_multiplier
    assert truncated_epsilon(sigma, 30) <= 4.0 < truncated_epsilon(sigma * (1 - 2e-3), 30)
    assert engine.plan.report(DELTA)["sampling"] == "truncated_poisson"
    engine.detach()

    model = network()
    engine = PrivacyEngine(accountant="rdp")
    engine.make_private_with_epsilon(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=FixedSizeDataLoader(dataset(), batch_size=4, seed=1),
                                     target_epsilon=8.0, target_delta=DELTA, max_grad_norm=1.0, epochs=2)
    sigma = engine.noise_multiplier
    assert engine.plan.planned_steps == 10
    assert fixed_size_epsilon(sigma, 10, 4) <= 8.0 < fixed_size_epsilon(sigma * (1 - 2e-3), 10, 4)
    engine.detach()


def test_an_accountant_without_the_selections_event_is_refused_before_any_step():
    with pytest.raises(ValueError, match="accounted by the 'pld' accountant"):
        private(TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=1),
                engine=PrivacyEngine(accountant="rdp"))
    with pytest.raises(ValueError, match="accounted by the 'rdp' accountant"):
        private(FixedSizeDataLoader(dataset(), batch_size=4, seed=1))


def test_secure_mode_needs_secure_draws_and_gets_them():
    with pytest.raises(ValueError, match="secure_mode=True"):
        private(TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=1),
                engine=PrivacyEngine(secure_mode=True))
    with pytest.raises(ValueError, match="secure_mode=True"):
        private(FixedSizeDataLoader(dataset(), batch_size=4, seed=1), engine=PrivacyEngine("rdp", secure_mode=True))
    engine, model, optimizer, dp_loader = private(
        TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, secure_mode=True),
        engine=PrivacyEngine(secure_mode=True))
    x, y = next(iter(dp_loader))
    train_step(model, optimizer, x, y)
    assert engine.privacy_report(DELTA)["secure_mode"] and dp_loader.batch_sampler.secure
    engine.detach()


def test_what_the_padding_mask_cannot_follow_is_refused():
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=1)
    with pytest.raises(RuntimeError, match="only once make_private attached its privacy plan"):
        next(iter(loader))
    engine, model, optimizer, dp_loader = private(loader)
    with pytest.raises(ValueError, match="cannot split the padded batches"):
        BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=2, optimizer=optimizer)
    batches = (batch for _ in range(9) for batch in dp_loader)  # over the epochs' ends
    x, y = next(batches)
    train_step(model, optimizer, x.clone() * 1.0, y.clone())  # derived by torch operations, all rows in order
    x, y = next(batches)
    with pytest.raises(PerSampleGradientError, match="reorders the batch"):  # padding rows moved off the end
        nn.functional.cross_entropy(model(x.flip(0)), y.flip(0), reduction="sum").backward()
    optimizer.zero_grad()
    with pytest.raises(SamplingMismatchError, match="on 3 rows"):  # a part: its rows' places are not the draw's
        nn.functional.cross_entropy(model(x[3:]), y[3:], reduction="sum").backward()
    optimizer.zero_grad()  # the refused pass is dropped
    stale = x, y
    x, y = next(batches)
    with pytest.raises(SamplingMismatchError, match="a batch other than the latest draw's"):  # its padding differs
        nn.functional.cross_entropy(model(stale[0]), stale[1], reduction="sum").backward()
    optimizer.zero_grad()
    engine.hooks.set_privacy_units(torch.arange(B) // 2)
    with pytest.raises(SamplingMismatchError, match="privacy units"):
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    optimizer.zero_grad()
    engine.hooks.set_privacy_units(None)
    train_step(model, optimizer, x, y)
    assert engine.plan.steps == 3  # every draw handed out
    engine.detach()
    with pytest.raises(ValueError, match="bandmf"):
        private(TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=1),
                noise_mechanism="bandmf", bands=1)
    with pytest.raises(ValueError, match="in_order=True"):
        TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, num_workers=1, in_order=False)
