"""make_private(poisson_sampling=False): the loader's fixed-size batches, each pass one Gaussian of sigma / 2."""

import math
from statistics import NormalDist

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SubsetRandomSampler, TensorDataset, WeightedRandomSampler

from dptorch import BatchMemoryManager, PrivacyEngine
from dptorch.data.shuffled import RepeatedSampleError, ShuffledBatchSampler
from dptorch.plan import SamplingMismatchError

N, BATCH = 48, 12


def setup(shuffle=False, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 3, (N,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data, batch_size=BATCH, shuffle=shuffle)


def private(sigma=1.0, clip=1.0, shuffle=False, **kwargs):
    model, opt, dl = setup(shuffle)
    engine = PrivacyEngine(accountant=kwargs.pop("accountant", "pld"))
    hooks, dp_opt, dp_dl = engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=sigma,
                                               max_grad_norm=clip, poisson_sampling=False, wrap_model=False, **kwargs)
    return engine, model, dp_opt, dp_dl


def step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def gaussian_epsilon(mu, delta):
    """Epsilon of mu-GDP at delta (the Gaussian mechanism's exact curve), by bisection."""
    normal = NormalDist()

    def delta_of(eps):
        return normal.cdf(-eps / mu + mu / 2) - math.exp(eps) * normal.cdf(-eps / mu - mu / 2)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def test_each_pass_is_one_gaussian_of_half_the_noise_multiplier():
    sigma = 1.5
    engine, model, opt, dl = private(sigma, shuffle=True)
    for _ in range(3):
        for batch in dl:
            step(model, opt, batch)
    assert engine.plan.steps == 3 * len(dl) and engine.plan.passes == 3
    assert engine.accountant.history == [[sigma / 2, 1.0, 3]]
    # mu = sqrt(passes) * 2C / (sigma C): the exact Gaussian curve, which PLD bounds from above
    exact = gaussian_epsilon(2 * math.sqrt(3) / sigma, 1e-5)
    assert exact <= engine.get_epsilon(1e-5) <= exact * 1.001
    report = engine.plan.report(1e-5)
    assert report["sampling"] == "shuffled" and report["passes"] == 3 and report["adjacency"] == "replace one unit"
    assert "no amplification" in report["accounting"]


def test_a_pass_broken_off_counts_whole_and_a_new_iter_is_a_new_pass():
    engine, model, opt, dl = private()
    for i, batch in enumerate(dl):
        step(model, opt, batch)
        if i == 1:
            break
    assert engine.plan.passes == 1
    step(model, opt, next(iter(dl)))
    assert engine.plan.passes == 2 and engine.accountant.history == [[0.5, 1.0, 2]]


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
def test_clipped_sums_match_each_sample_alone_in_the_loaders_order():
    clip = 0.05
    engine, model, opt, dl = private(sigma=0.0, clip=clip)
    reference, _, plain = setup()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for batch, plain_batch in zip(dl, plain):
        assert torch.equal(batch[0], plain_batch[0])  # the loader's own order (shuffle=False)
        summed = [torch.zeros_like(p) for p in reference.parameters()]
        for x, y in zip(*plain_batch):
            grads = torch.autograd.grad(nn.functional.cross_entropy(reference(x[None]), y[None]), list(reference.parameters()))
            factor = min(1.0, clip / float(torch.sqrt(sum((g ** 2).sum() for g in grads))))
            summed = [s + factor * g for s, g in zip(summed, grads)]
        for p, s in zip(reference.parameters(), summed):
            p.grad = s / BATCH
        ref_opt.step()
        step(model, opt, batch)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
def test_one_sample_changes_exactly_one_step_of_a_pass_by_at_most_2c():
    """Replace-one: swap one sample, same order; the per-step clipped sums differ in one step only, by <= 2C."""
    clip = 0.1

    def pass_sums(dataset):
        model, opt, _ = setup()
        engine = PrivacyEngine()
        hooks, dp_opt, dl = engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(dataset, batch_size=BATCH),
                                                noise_multiplier=0.0, max_grad_norm=clip, poisson_sampling=False,
                                                wrap_model=False, loss_reduction="sum")
        sums = []
        for x, y in dl:
            dp_opt.zero_grad()
            nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
            dp_opt.pre_step()
            sums.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            dp_opt.zero_grad()
        return torch.stack(sums)

    _, _, dl = setup()
    x, y = dl.dataset.tensors
    x2, y2 = x.clone(), y.clone()
    x2[17] = 10 * torch.randn(4)
    y2[17] = (y[17] + 1) % 3
    diff = (pass_sums(TensorDataset(x, y)) - pass_sums(TensorDataset(x2, y2))).norm(dim=1)
    changed = (diff > 1e-6).nonzero().flatten().tolist()
    assert changed == [17 // BATCH]
    assert diff[changed[0]] <= 2 * clip * (1 + 1e-5)


def test_a_step_holding_batches_of_two_passes_is_refused():
    engine, model, opt, dl = private()
    first = iter(dl)
    opt.signal_skip_step(True)
    step(model, opt, next(first))  # a virtual step of pass 1
    second = iter(dl)
    opt.signal_skip_step(False)
    with pytest.raises(SamplingMismatchError, match="two passes"):
        step(model, opt, next(second))
    assert engine.plan.steps == 0


def test_gradient_accumulation_within_a_pass_and_batch_memory_manager():
    engine, model, opt, dl = private()
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=5, optimizer=opt) as physical:
        for batch in physical:
            step(model, opt, batch)
    assert engine.plan.steps == len(dl) and engine.plan.passes == 1
    # the same updates as whole batches
    engine2, model2, opt2, dl2 = private()
    for batch in dl2:
        step(model2, opt2, batch)
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_data_that_did_not_come_from_the_loader_is_refused():
    engine, model, opt, dl = private()
    _, _, plain = setup()
    with pytest.raises(SamplingMismatchError, match="no Poisson draw"):
        step(model, opt, next(iter(plain)))


@pytest.mark.parametrize("make, match", [
    (lambda d: DataLoader(d, batch_size=4, sampler=RandomSampler(d, replacement=True)), "replacement=True"),
    (lambda d: DataLoader(d, batch_size=4, sampler=RandomSampler(d, num_samples=2 * N)), "num_samples=96"),
    (lambda d: DataLoader(d, batch_size=4, sampler=WeightedRandomSampler([1.0] * N, N)), "WeightedRandomSampler"),
    (lambda d: DataLoader(d, batch_size=4, sampler=SubsetRandomSampler(range(10))), "SubsetRandomSampler"),
    (lambda d: DataLoader(d, batch_sampler=[[0, 1], [2, 3]]), "list"),
    (lambda d: DataLoader(TensorDataset(d.tensors[0][:0], d.tensors[1][:0]), batch_size=4), "empty"),
])
def test_loaders_the_bound_does_not_cover_are_refused(make, match):
    model, opt, dl = setup()
    with pytest.raises(ValueError, match=match):
        PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=make(dl.dataset), noise_multiplier=1.0,
                                     max_grad_norm=1.0, poisson_sampling=False)


def test_a_repeat_within_a_pass_raises():
    sampler = ShuffledBatchSampler(BatchSampler([0, 1, 2, 1], batch_size=2, drop_last=False), num_samples=3)
    with pytest.raises(RepeatedSampleError):
        list(sampler)


@pytest.mark.parametrize("options, match", [
    (dict(clipping="adaptive", target_unclipped_quantile=0.5), "adaptive"),
    (dict(clipping_stats="private"), "clipping_stats"),
    (dict(noise_mechanism="bandmf", bands=2), "bandmf"),
])
def test_mechanisms_accounted_for_poisson_only_are_refused(options, match):
    model, opt, dl = setup()
    with pytest.raises(ValueError, match=match):
        PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0,
                                     max_grad_norm=1.0, poisson_sampling=False, **options)


@pytest.mark.parametrize("epochs", [2, 1.5])
def test_calibration_over_passes(epochs):
    model, opt, dl = setup()
    engine = PrivacyEngine()
    _, dp_opt, dp_dl = engine.make_private_with_epsilon(module=model, optimizer=opt, data_loader=dl, target_epsilon=8.0,
                                                        target_delta=1e-5, max_grad_norm=1.0, epochs=epochs,
                                                        poisson_sampling=False, wrap_model=False)
    passes = math.ceil(epochs)
    sigma = engine.noise_multiplier
    exact = gaussian_epsilon(2 * math.sqrt(passes) / sigma, 1e-5)
    assert 8.0 * 0.98 <= exact <= 8.0
    steps = round(epochs * len(dp_dl))
    done = 0
    while done < steps:
        for batch in dp_dl:
            step(model, dp_opt, batch)
            done += 1
            if done == steps:
                break
    assert engine.plan.passes == passes and engine.get_epsilon(1e-5) <= 8.0


def test_resume_continues_the_pass_count(tmp_path):
    engine, model, opt, dl = private(shuffle=True)
    for i, batch in enumerate(dl):
        step(model, opt, batch)
        if i == 1:
            break
    engine.save_checkpoint(tmp_path / "ckpt.pt", module=model, optimizer=opt, data_loader=dl)
    resumed, model2, opt2, dl2 = private(shuffle=True)
    resumed.load_checkpoint(tmp_path / "ckpt.pt", module=model2, optimizer=opt2, data_loader=dl2)
    assert resumed.plan.passes == 1 and resumed.plan.steps == 2
    for batch in dl2:  # the resumed run's pass is a new one: its samples may repeat the broken-off pass's
        step(model2, opt2, batch)
    assert resumed.plan.passes == 2 and resumed.accountant.history == [[0.5, 1.0, 2]]
    poisson_model, poisson_opt, poisson_dl = setup()
    poisson = PrivacyEngine()
    _, poisson_opt, poisson_dl = poisson.make_private(module=poisson_model, optimizer=poisson_opt, data_loader=poisson_dl,
                                                      noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
    with pytest.raises(ValueError, match="sampling"):
        poisson.load_checkpoint(tmp_path / "ckpt.pt", module=poisson_model, optimizer=poisson_opt)


def test_secure_mode_draws_the_noise_securely_and_keeps_the_order():
    model, opt, plain = setup()
    engine = PrivacyEngine(secure_mode=True)
    _, dp_opt, dp_dl = engine.make_private(module=model, optimizer=opt, data_loader=plain, noise_multiplier=1.0,
                                           max_grad_norm=1.0, poisson_sampling=False, wrap_model=False)
    for batch, plain_batch in zip(dp_dl, plain):
        assert torch.equal(batch[1], plain_batch[1])
        step(model, dp_opt, batch)
    assert engine.plan.passes == 1 and engine.plan.secure_mode
