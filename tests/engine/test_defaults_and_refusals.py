"""A newcomer's defaults and refusals: grad_sample_mode="auto", delta below 1/N, empty data, samplers
that Poisson sampling would silently replace, and error messages that never cut a list silently."""

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from dptorch import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks, register_grad_sampler
from dptorch.grad_sample.modes.auto import choose_grad_sample_mode
from dptorch.grad_sample.errors import PerSampleGradientError


def data(n=64, features=6):
    torch.manual_seed(0)
    return TensorDataset(torch.randn(n, features), torch.randint(0, 2, (n,)))


def private(model, loader=None, engine=None, **options):
    engine = engine or PrivacyEngine()
    loader = DataLoader(data(), batch_size=16) if loader is None else loader
    options = {"noise_multiplier": 1.0, **options}
    _hooks, optimizer, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                    data_loader=loader, max_grad_norm=1.0, wrap_model=False, **options)
    return engine, (model, optimizer, loader)


# -- grad_sample_mode="auto" ---------------------------------------------------------------------


def test_auto_is_the_default_and_runs_bk_when_a_trainable_layer_has_a_norm_sampler(caplog):
    with caplog.at_level(logging.INFO, logger="dptorch.engine"):
        engine, _ = private(nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2)))
    assert engine.grad_sample_mode == "bk" and engine.hooks.grad_sample_mode == "bk"
    assert engine.privacy_report(1e-5)["grad_sample_mode"] == "bk"
    assert "grad_sample_mode='auto' runs 'bk'" in caplog.text


def test_auto_runs_hooks_when_no_trainable_layer_has_a_norm_sampler():
    frozen_linear = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8))
    frozen_linear[0].requires_grad_(False)
    assert choose_grad_sample_mode(frozen_linear) == "hooks"
    conv = nn.Sequential(nn.Conv1d(1, 2, 3), nn.GroupNorm(1, 2))
    assert choose_grad_sample_mode(conv) == "hooks"
    engine, _ = private(frozen_linear)
    assert engine.grad_sample_mode == "hooks" and engine.privacy_report(1e-5)["grad_sample_mode"] == "hooks"


def test_explicit_modes_are_kept_and_unknown_ones_refused():
    engine, _ = private(nn.Linear(6, 2), grad_sample_mode="hooks")
    assert engine.grad_sample_mode == "hooks"
    with pytest.raises(ValueError, match="grad_sample_mode must be one of .*'auto'"):
        private(nn.Linear(6, 2), grad_sample_mode="fast")


def test_auto_gives_the_update_hooks_gives():
    """bk is exact: the clipped, noiseless update of auto (bk) equals the one of hooks."""
    updates, drawn = {}, {}
    for mode in ("auto", "hooks"):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 2))
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.warns(UserWarning, match="noise_multiplier=0"):
            engine, (model, optimizer, loader) = private(model, noise_multiplier=0.0, grad_sample_mode=mode)
        x, y = next(iter(loader))  # the same draw in both runs (the sampler's seed follows torch.manual_seed)
        drawn[engine.grad_sample_mode] = y.clone()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        updates[engine.grad_sample_mode] = [p.detach() - b for p, b in zip(model.parameters(), before)]
    assert len(drawn["bk"]) > 0 and torch.equal(drawn["bk"], drawn["hooks"])
    for bk, hooks in zip(updates["bk"], updates["hooks"]):
        torch.testing.assert_close(bk, hooks, rtol=1e-5, atol=1e-7)


# -- delta and data ------------------------------------------------------------------------------


def test_make_private_with_epsilon_refuses_a_delta_not_below_one_over_n():
    model = nn.Linear(6, 2)
    with pytest.raises(ValueError, match=r"target_delta=0.02 is not below 1/N for N=64"):
        PrivacyEngine().make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=16), target_epsilon=3.0, target_delta=0.02, epochs=1,
            max_grad_norm=1.0,
        )


def test_get_epsilon_refuses_a_meaningless_delta_instead_of_returning_zero():
    engine, (model, optimizer, loader) = private(nn.Linear(6, 2))
    for x, y in loader:
        optimizer.zero_grad()
        if len(y):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert engine.get_epsilon(1e-5) > 0
    with pytest.raises(ValueError, match="delta=0.5 is not below 1/N for N=64"):
        engine.get_epsilon(0.5)
    for delta in (0.0, 1.0, -1e-5):
        with pytest.raises(ValueError, match=r"delta must be a number in \(0, 1\)"):
            engine.get_epsilon(delta)
    with pytest.raises(ValueError, match="not below 1/N"):
        engine.privacy_report(0.5)


def test_an_empty_dataset_is_refused_by_name():
    empty = DataLoader(TensorDataset(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match=r"dataset is empty \(0 samples\)"):
        private(nn.Linear(6, 2), loader=empty)
    model = nn.Linear(6, 2)
    with pytest.raises(ValueError, match=r"dataset is empty"):
        PrivacyEngine().make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=empty,
            target_epsilon=3.0, target_delta=1e-5, epochs=1, max_grad_norm=1.0,
        )


# -- samplers ------------------------------------------------------------------------------------


class EveryOther(Sampler):
    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return iter(range(0, self.size, 2))

    def __len__(self):
        return (self.size + 1) // 2


@pytest.mark.parametrize("sampler", [
    WeightedRandomSampler(torch.ones(64), 64),
    SubsetRandomSampler(range(10)),
    EveryOther(64),
    RandomSampler(range(64), replacement=True),
], ids=["weighted", "subset", "custom", "with-replacement"])
def test_a_sampler_poisson_sampling_would_drop_is_refused_with_the_fix(sampler):
    loader = DataLoader(data(), batch_size=8, sampler=sampler)
    with pytest.raises(ValueError, match=r"(?s)draws its samples with .*Subset\(dataset, indices\)"):
        private(nn.Linear(6, 2), loader=loader)
    problems = PrivacyEngine().compatibility_problems(module=nn.Linear(6, 2), data_loader=loader)
    assert any("Poisson sampling" in problem for problem in problems)


@pytest.mark.parametrize("make", [
    lambda ds: DataLoader(ds, batch_size=8),
    lambda ds: DataLoader(ds, batch_size=8, shuffle=True),
    lambda ds: DataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(SequentialSampler(ds), 8, False)),
    lambda ds: DataLoader(Subset(ds, range(10, 42)), batch_size=8, shuffle=True),
], ids=["sequential", "shuffled", "batch-sampler", "subset-dataset"])
def test_the_default_samplers_and_a_subset_dataset_are_accepted(make):
    engine, (_, _, loader) = private(nn.Linear(6, 2), loader=make(data()))
    assert engine.plan.num_units == len(loader.dataset)


# -- messages ------------------------------------------------------------------------------------


def test_a_grad_sampler_that_returns_none_is_told_to_return_a_dict():
    class Odd(nn.Linear):
        pass

    @register_grad_sampler(Odd)
    def forgetful(module, activations, backprops):
        module.weight  # computes nothing, returns None

    model = Odd(3, 2)
    with GradSampleHooks(model, loss_reduction="sum", grad_sample_mode="hooks"):
        with pytest.raises(PerSampleGradientError, match="returned NoneType: a grad sampler must return a dict"):
            model(torch.randn(4, 3)).sum().backward()


def test_lists_in_messages_say_how_many_more_there_are():
    model, other = nn.Linear(6, 2), nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    optimizer = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    with pytest.raises(ValueError, match=r"6 parameter\(s\) .*\(2, 2\), \(2,\), \(2, 2\), \(2,\), \(2, 2\) and 1 more"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=DataLoader(data(), batch_size=16),
                                     noise_multiplier=1.0, max_grad_norm=1.0)
