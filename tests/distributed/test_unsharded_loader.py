"""Under a process group of 2 ranks (gloo, loopback), a Poisson loader not sharded for it is refused.

A ``DPDataLoader(dataset, sample_rate=q)`` built without ``distributed=True`` draws a Poisson sample
of the whole dataset on every rank (with one seed, the very same rows on both); the DP optimizer
adds the ranks' clipped sums, so one row moved the noiseless update by 2 C while noise, divisor and
accountant assumed one draw. Every loader kind is refused (cyclic Poisson for bandmf too), at
``make_private`` and, for a process group started after it, at the first batch; a plain loader or
a ``distributed=True`` one is sharded: the ranks' draws are disjoint pieces of one global draw.
"""

from __future__ import annotations

import datetime
import os
import re
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.distributed.launch import run_spawned
from tests.distributed.workers import reader

WORLD = 2
N, Q, SEED = 24, 0.5, 7
REFUSED = r"draw its own Poisson sample of the whole dataset.*sensitivity 2 C.*distributed=True"


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.arange(N).float().unsqueeze(1).repeat(1, 3) + torch.randn(N, 3, generator=g),
                         torch.arange(N))


def make_private(loader, **options):
    from dptorch import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    engine = PrivacyEngine()
    _hooks, optimizer, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                    data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                                    wrap_model=False, **{"loss_reduction": "sum", **options})
    return engine, (model, optimizer, loader)  # loss_reduction="sum": the tests back-propagate sums


def refusal(build) -> str:
    """The message make_private refuses ``build()``'s loader with ('' when accepted)."""
    try:
        make_private(build())
    except ValueError as err:
        return str(err)
    return ""


def trained_rows(loader_of) -> list:
    """Indices of the rows each step of one epoch trained on (this rank's part)."""
    engine, (model, optimizer, loader) = make_private(loader_of())
    rows = []
    for x, index in loader:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        rows.append(index.tolist())
    return rows


def scenarios():
    from dptorch.data import CyclicPoissonDataLoader, DPDataLoader, PoissonBatchSampler

    yield "dp-loader", lambda: refusal(lambda: DPDataLoader(dataset(), sample_rate=Q, seed=SEED))
    yield "cyclic", lambda: refusal(lambda: CyclicPoissonDataLoader(dataset(), sample_rate=Q, bands=2, seed=SEED))
    yield "cyclic-bandmf", lambda: _refused_bandmf()
    yield "compatible", lambda: _compatibility()
    yield "sharded", lambda: trained_rows(lambda: DPDataLoader(dataset(), sample_rate=Q, seed=SEED, distributed=True))
    # a plain loader with a Poisson batch sampler of one process: make_private rebuilds it sharded
    yield "rebuilt", lambda: trained_rows(
        lambda: DataLoader(dataset(), batch_sampler=PoissonBatchSampler(N, Q, seed=SEED)))
    yield "shuffled", lambda: _refused_shuffled()


def _refused_shuffled() -> str:
    """poisson_sampling=False: each rank's loader would pass over the whole dataset; refused."""
    try:
        make_private(DataLoader(dataset(), batch_size=4, shuffle=True), poisson_sampling=False)
    except ValueError as err:
        return str(err)
    return ""


def _refused_bandmf() -> str:
    from dptorch.data import CyclicPoissonDataLoader

    try:
        make_private(CyclicPoissonDataLoader(dataset(), sample_rate=Q, bands=2, seed=SEED),
                     noise_mechanism="bandmf", bands=2)
    except ValueError as err:
        return str(err)
    return ""


def _compatibility() -> list:
    from dptorch import PrivacyEngine
    from dptorch.data import DPDataLoader

    model = nn.Linear(3, 1)
    return PrivacyEngine().compatibility_problems(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DPDataLoader(dataset(), sample_rate=Q, seed=SEED))


def late_process_group(rank: int, store: str) -> str:
    """make_private on one process, then a process group of 2: the first batch is refused."""
    from dptorch.data import DPDataLoader

    _, (model, optimizer, loader) = make_private(DPDataLoader(dataset(), sample_rate=Q, seed=SEED))
    _, (_, _, shuffled) = make_private(DataLoader(dataset(), batch_size=4), poisson_sampling=False)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    messages = []
    try:
        for dp_loader in (loader, shuffled):
            try:
                next(iter(dp_loader))
                messages.append("")
            except ValueError as err:
                messages.append(str(err))
    finally:
        dist.destroy_process_group()
    return messages


def worker(rank: int, folder: str, results) -> None:
    torch.set_num_threads(1)
    results[("late", rank)] = _safely(lambda: late_process_group(rank, os.path.join(folder, "late")))
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        for name, run in scenarios():
            results[(name, rank)] = _safely(run)
    finally:
        dist.destroy_process_group()


def _safely(run):
    try:
        return run()
    except Exception:
        return {"error": traceback.format_exc()}


@pytest.fixture(scope="module")
def runs():
    return reader(run_spawned(worker, WORLD, store=False))


@pytest.mark.parametrize("name", ["dp-loader", "cyclic", "cyclic-bandmf"])
def test_a_loader_not_sharded_for_the_process_group_is_refused_on_every_rank(runs, name):
    for rank in range(WORLD):
        message = runs(name, rank)
        assert re.search(REFUSED, message, re.S), message
        assert f"rank {rank} of {WORLD} processes" in message


def test_compatibility_problems_name_it(runs):
    for rank in range(WORLD):
        assert any("without distributed=True" in problem for problem in runs("compatible", rank))


def test_a_process_group_started_after_make_private_is_refused_at_the_first_batch(runs):
    for rank in range(WORLD):
        poisson, shuffled = runs("late", rank)
        assert "without distributed=True" in poisson
        assert "poisson_sampling=False is not supported under torch.distributed" in shuffled


def test_shuffled_batches_are_refused_under_a_process_group(runs):
    for rank in range(WORLD):
        assert "poisson_sampling=False is not supported under torch.distributed" in runs("shuffled", rank)


@pytest.mark.parametrize("name", ["sharded", "rebuilt"])
def test_sharded_loaders_give_disjoint_pieces_of_one_global_draw(runs, name):
    from dptorch.data import PoissonBatchSampler

    per_rank = [runs(name, rank) for rank in range(WORLD)]
    assert len(per_rank[0]) == len(per_rank[1]) == round(1 / Q)  # the same steps on both ranks
    for rank, steps in enumerate(per_rank):
        assert all(index % WORLD == rank for step in steps for index in step)  # shard rank::world_size
    if name == "sharded":  # one seed: together the ranks drew exactly the one-process draws of that seed
        one_process = PoissonBatchSampler(N, Q, seed=SEED)
        for step, expected in enumerate(one_process):
            assert sorted(per_rank[0][step] + per_rank[1][step]) == expected
    assert any(len(step) for steps in per_rank for step in steps)  # something was drawn: the check means something
