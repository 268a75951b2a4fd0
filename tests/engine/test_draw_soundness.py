"""A step whose backward passes saw rows that no draw of the DP data loader gave the loop is refused.

After ``hooks, optimizer, dp_loader = engine.make_private(..., wrap_model=False)``, a loop that keeps iterating the
original loader (or trains on the whole dataset) never draws a Poisson batch; each step used to be
accounted as a Poisson step at the loader's rate (50 full-dataset steps at sigma 1: epsilon 6.39
reported, 54.4 true at q = 1). The plan's draw ledger refuses such a step before anything changes,
in every form a loop can take (virtual steps, BatchMemoryManager, DPLoss, privacy units, cyclic
Poisson sampling, a resumed run), while a ``DPOptimizer`` built by hand keeps working.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import BatchMemoryManager, PrivacyEngine
from dptorch.accounting import create_accountant
from dptorch.data import DPDataLoader
from dptorch.grad_sample import GradSampleHooks
from dptorch.optim import DPOptimizer
from dptorch.plan import SamplingMismatchError

N, BATCH = 40, 4  # q = 1/10
UNDRAWN = "no Poisson draw of the DP data loader"


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 2, (N,), generator=g))


def private(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    loader = DataLoader(dataset(), batch_size=BATCH)
    engine = PrivacyEngine()
    settings = dict(noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False, loss_reduction="sum")
    settings.update(options)
    _hooks, *rest = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data_loader=loader, **settings)
    return (engine, loader, model, *rest)  # the model trains itself; the controller is engine.hooks


def loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="sum")


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def unchanged(model, before):
    return all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_the_whole_dataset_every_step_is_refused_at_the_first_step():
    engine, _, model, optimizer, _ = private()
    x, y = dataset().tensors
    before = snapshot(model)
    loss(model, x, y).backward()
    with pytest.raises(SamplingMismatchError, match=f"{N} samples that {UNDRAWN}.*sample rate 0.1.*sample rate 1"):
        optimizer.step()
    assert unchanged(model, before) and len(engine.accountant) == 0 and engine.plan.steps == 0
    # What was at stake: 50 such steps were reported at q = 0.1; they are q = 1 steps.
    reported, true = create_accountant("pld"), create_accountant("pld")
    reported.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=50)
    true.step(noise_multiplier=1.0, sample_rate=1.0, num_steps=50)
    assert true.get_epsilon(1e-5) > 5 * reported.get_epsilon(1e-5)


def test_iterating_the_original_loader_is_refused_and_the_returned_one_trains():
    engine, original, model, optimizer, dp_loader = private()
    x, y = next(iter(original))
    loss(model, x, y).backward()
    with pytest.raises(SamplingMismatchError, match="Iterate the data loader make_private returned"):
        optimizer.step()
    optimizer.zero_grad()  # drops the held gradients, as the message says
    steps = 0
    for x, y in dp_loader:  # empty Poisson batches included: q = 1/10 of 40
        optimizer.zero_grad()
        loss(model, x, y).backward()
        optimizer.step()
        steps += 1
    assert steps == len(dp_loader) == 10 and len(engine.accountant) == 10


def test_undrawn_rows_before_a_draw_in_the_same_step_are_refused():
    """A backward on other data, then a real draw and its backward: the step mixes both."""
    engine, _, model, optimizer, dp_loader = private()
    loss(model, torch.randn(3, 5), torch.tensor([0, 1, 0])).backward()
    x, y = next(iter(dp_loader))
    loss(model, x, y).backward()
    with pytest.raises(SamplingMismatchError, match=f"3 samples that {UNDRAWN}"):
        optimizer.step()
    assert len(engine.accountant) == 0


def test_a_step_without_any_backward_is_a_noise_only_step_not_a_refusal():
    """No rows seen: nothing undrawn reached the update (the step is accounted, as an empty draw would be)."""
    engine, _, model, optimizer, _ = private()
    optimizer.step()
    assert len(engine.accountant) == 1


def test_batch_memory_manager_over_the_original_loader_is_refused_and_over_the_dp_loader_trains():
    engine, original, model, optimizer, dp_loader = private()
    with BatchMemoryManager(data_loader=original, max_physical_batch_size=2, optimizer=optimizer) as batches:
        with pytest.raises(SamplingMismatchError, match=UNDRAWN):
            for x, y in batches:
                loss(model, x, y).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert len(engine.accountant) == 0 and optimizer._step_skip_queue == []  # the refused step took its signal
    optimizer.zero_grad()
    with BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=2, optimizer=optimizer) as batches:
        for x, y in batches:  # virtual steps: several physical batches of one draw
            loss(model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert len(engine.accountant) == len(dp_loader) == 10


def test_dp_loss_and_privacy_units_are_held_to_the_same_rule():
    engine, original, model, optimizer, criterion, dp_loader = private(criterion=nn.CrossEntropyLoss(reduction="sum"))
    x, y = next(iter(original))
    criterion(model(x), y).backward()
    with pytest.raises(SamplingMismatchError, match=f"{BATCH} samples that {UNDRAWN}"):
        optimizer.step()
    optimizer.zero_grad()
    engine.hooks.set_privacy_units(torch.tensor([0, 0, 1, 1]))  # two units of two rows, not from a draw
    criterion(model(x), y).backward()
    with pytest.raises(SamplingMismatchError, match=f"2 privacy units that {UNDRAWN}"):
        optimizer.step()
    assert len(engine.accountant) == 0


def test_cyclic_poisson_sampling_for_bandmf_is_held_to_the_same_rule():
    engine, original, model, optimizer, dp_loader = private(noise_mechanism="bandmf", bands=2)
    x, y = next(iter(original))
    loss(model, x, y).backward()
    with pytest.raises(SamplingMismatchError, match=UNDRAWN):
        optimizer.step()
    optimizer.zero_grad()
    for x, y in dp_loader:
        optimizer.zero_grad()
        loss(model, x, y).backward()
        optimizer.step()
    assert engine.plan.steps == len(dp_loader)


def test_the_ledger_survives_a_checkpoint(tmp_path):
    """Undrawn rows held at save time are still refused after the resume; a resumed loop over the loader trains."""
    engine, original, model, optimizer, dp_loader = private()
    for x, y in dp_loader:
        optimizer.zero_grad()
        loss(model, x, y).backward()
        optimizer.step()
        break
    x, y = next(iter(original))
    loss(model, x, y).backward()  # held, not stepped
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path, module=model, optimizer=optimizer, data_loader=dp_loader)

    resumed, _, model2, optimizer2, loader2 = private()
    resumed.load_checkpoint(path, module=model2, optimizer=optimizer2, data_loader=loader2)
    assert resumed.plan.draws.undrawn == BATCH and resumed.plan.steps == 1
    with pytest.raises(SamplingMismatchError, match=f"{BATCH} samples that {UNDRAWN}"):
        optimizer2.step()
    optimizer2.zero_grad()
    for x, y in loader2:
        optimizer2.zero_grad()
        loss(model2, x, y).backward()
        optimizer2.step()
    assert resumed.plan.steps == 10  # the rest of the first epoch


def test_a_dp_optimizer_built_by_hand_keeps_working_with_its_own_sampler_and_accountant():
    """No plan from make_private, no ledger: the caller samples and accounts (docs/privacy.md says so)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 2))
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=1.0,
                            max_grad_norm=1.0, expected_batch_size=4.0, loss_reduction="sum")
    accountant = create_accountant("pld")
    loader = DPDataLoader(dataset(), sample_rate=0.1, seed=3)  # not attached to any plan
    x, y = dataset().tensors
    loss(model, x[:4], y[:4]).backward()  # the caller's own batch: not checked
    optimizer.step()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    for x, y in loader:
        optimizer.zero_grad()
        loss(model, x, y).backward()
        optimizer.step()
        accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    assert optimizer.plan.draws is None and optimizer.plan.steps == 11 and len(accountant) == 11
    hooks.cleanup()
