"""Ranks that disagree on the privacy plan are refused on every rank, with one message, and none hangs.

Two processes (gloo, loopback), one spawn for every scenario: each builds a set-up that differs
between the ranks in one way (the loader's batch size, the dataset's length as with data pre-sharded
per rank, the noise multiplier, the clipping bound, a calibrated run's data, a bare DPOptimizer's
expected batch size) and records the error ``make_private`` (or the optimizer) raises, or
``"accepted"``. Before this check each rank built its own plan: rank 1's rows were drawn at another
rate (or from another N) than rank 0's accountant recorded, and ranks with other steps per epoch
waited for each other until the collective timed out. The scenarios run one after the other in the
same processes, so a rank left waiting in a gather would stall the next scenario (and fail it at the
collective timeout).
"""

from __future__ import annotations

import datetime
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch.distributed.agreement import disagreement, plan_terms
from dptorch.plan import PrivacyPlan
from tests.distributed.launch import run_spawned

WORLD = 2
N = 24


def dataset(rows: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(rows, 3, generator=g), torch.randn(rows, 1, generator=g))


def attempt(rank: int, *, batch_size=(4, 4), rows=(N, N), noise=(1.0, 1.0), clip=(1.0, 1.0), epsilon=None):
    """make_private (with ``epsilon``: make_private_with_epsilon) with this rank's entry of each pair; the error,
    or ``"accepted"`` after one step. With the error: whether the model was left untouched (no hook, no plan)."""
    from dptorch import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    engine = PrivacyEngine()
    common = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=clip[rank],
                  data_loader=DataLoader(dataset(rows[rank]), batch_size=batch_size[rank]), wrap_model=False, loss_reduction="sum")
    try:
        if epsilon is None:
            _, optimizer, loader = engine.make_private(noise_multiplier=noise[rank], **common)
        else:
            _, optimizer, loader = engine.make_private_with_epsilon(target_epsilon=epsilon, target_delta=0.03,
                                                                    epochs=1, **common)
    except ValueError as err:
        return {"error": str(err), "untouched": engine.plan is None and not model._forward_hooks}
    x, y = next(iter(loader))
    ((model(x) - y) ** 2).sum().backward()
    optimizer.step()
    return "accepted"


def bare_optimizer(rank: int):
    """Opacus' keywords: DPOptimizer(noise_multiplier, max_grad_norm, expected_batch_size) differing per rank."""
    from dptorch.grad_sample import GradSampleHooks
    from dptorch.optim import DPOptimizer

    model = nn.Linear(3, 1)
    hooks = GradSampleHooks(model, loss_reduction="sum")
    try:
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=1.0, max_grad_norm=1.0,
                    expected_batch_size=4.0 * (rank + 1))
    except ValueError as err:
        return str(err)
    finally:
        hooks.cleanup()
    return "accepted"


def scenarios(rank: int):
    yield "batch-size", lambda: attempt(rank, batch_size=(4, 8))
    yield "dataset-length", lambda: attempt(rank, rows=(N, 2 * N))
    yield "noise", lambda: attempt(rank, noise=(1.0, 1.5))
    yield "clip", lambda: attempt(rank, clip=(1.0, 2.0))
    # target_delta 0.03 is below 1/24 but not below 1/48: rank 1 alone would refuse it, leaving rank 0 in the gather
    yield "with-epsilon", lambda: attempt(rank, rows=(N, 2 * N), epsilon=4.0)
    yield "bare-optimizer", lambda: bare_optimizer(rank)
    yield "same", lambda: attempt(rank)
    yield "same-with-epsilon", lambda: attempt(rank, epsilon=4.0)


def worker(rank: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        for name, run in scenarios(rank):
            try:
                results[(name, rank)] = run()
            except Exception:
                results[(name, rank)] = {"crash": traceback.format_exc()}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    return run_spawned(worker, WORLD)


def refusals(runs, name) -> str:
    """The one message both ranks refused scenario ``name`` with (each rank left untouched)."""
    got = [runs[(name, rank)] for rank in range(WORLD)]
    for outcome in got:
        assert isinstance(outcome, dict) and "error" in outcome, outcome
        assert outcome["untouched"]
    assert got[0]["error"] == got[1]["error"]
    return got[0]["error"]


def test_a_different_batch_size_per_rank_is_refused_on_both_ranks_with_one_message(runs):
    message = refusals(runs, "batch-size")
    # 24 rows in batches of 4 and 8: q = 1/6 and 1/3, 6 and 3 steps per epoch
    assert "sample_rate: 0.16666666666666666 on rank 0 vs 0.3333333333333333 on rank 1" in message
    assert "steps_per_epoch: 6 on rank 0 vs 3 on rank 1" in message
    assert "same data loader settings" in message and "Nothing was changed" in message


def test_a_different_dataset_length_per_rank_pre_sharded_data_is_refused(runs):
    message = refusals(runs, "dataset-length")
    assert "num_units: 24 on rank 0 vs 48 on rank 1" in message
    assert "pre-sharded per rank is not supported" in message and "Pass the whole dataset to every rank" in message


@pytest.mark.parametrize("name,term", [("noise", "noise_multiplier: 1.0 on rank 0 vs 1.5 on rank 1"),
                                       ("clip", "max_grad_norm: 1.0 on rank 0 vs 2.0 on rank 1")])
def test_different_noise_or_clipping_per_rank_is_refused(runs, name, term):
    message = refusals(runs, name)
    assert term in message and "same privacy arguments on every rank" in message


def test_a_calibrated_run_is_refused_on_both_ranks_before_one_rank_refuses_its_delta(runs):
    assert "num_units: 24 on rank 0 vs 48 on rank 1" in refusals(runs, "with-epsilon")


def test_a_bare_dp_optimizer_with_another_expected_batch_size_per_rank_is_refused(runs):
    messages = [runs[("bare-optimizer", rank)] for rank in range(WORLD)]
    assert messages[0] == messages[1] and "expected_batch_size: 4.0 on rank 0 vs 8.0 on rank 1" in messages[0]


@pytest.mark.parametrize("name", ["same", "same-with-epsilon"])
def test_identical_set_ups_train(runs, name):
    assert [runs[(name, rank)] for rank in range(WORLD)] == ["accepted"] * WORLD


def _plan(**fields):
    base = dict(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.25, num_units=40, steps_per_epoch=4)
    return PrivacyPlan(**{**base, **fields})


@pytest.mark.parametrize("change", [
    dict(num_units=80), dict(sample_rate=0.5), dict(steps_per_epoch=8), dict(noise_multiplier=2.0),
    dict(max_grad_norm=2.0), dict(expected_batch_size=5.0), dict(accountant="rdp"), dict(secure_mode=True),
    dict(planned_steps=7), dict(clipping="automatic"), dict(sampling="shuffled", track_draws=True),
])
def test_every_term_the_accounting_assumes_is_compared(change):
    """One process: a plan differing in one field from another is named by the message, by that field."""
    key = next(iter(change))
    message = disagreement([plan_terms(_plan()), plan_terms(_plan(**change))])
    assert f"{key}: " in message


def test_the_loss_reduction_is_compared_and_equal_plans_agree():
    assert disagreement([plan_terms(_plan(), loss_reduction="mean")] * 3) == ""
    message = disagreement([plan_terms(_plan(), loss_reduction="mean"), plan_terms(_plan(), loss_reduction="sum"),
                            plan_terms(_plan(), loss_reduction="mean")])
    assert "loss_reduction: 'mean' on ranks 0, 2 vs 'sum' on rank 1" in message


def test_a_calibrated_plan_is_compared_by_its_target_not_by_the_searched_noise():
    """Each rank's search meets the same target; its last bits may differ between CPUs, so they are not compared."""
    fields = dict(max_grad_norm=1.0, sample_rate=0.25, num_units=40, steps_per_epoch=4)
    plans = [PrivacyPlan.calibrated(target_epsilon=e, target_delta=1e-3, steps=8, **fields) for e in (2.0, 2.0, 3.0)]
    assert disagreement([plan_terms(p) for p in plans[:2]]) == ""
    plans[1].noise_multiplier = plans[1].noise_multiplier * (1 + 1e-15)
    assert disagreement([plan_terms(p) for p in plans[:2]]) == ""
    assert "target_epsilon: 2.0 on rank 0 vs 3.0 on rank 1" in disagreement([plan_terms(p) for p in plans[1:]])
