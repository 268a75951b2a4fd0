import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dptorch.data import BatchMemoryManager, DPDataLoader, PoissonBatchSampler
from dptorch.data.memory_manager import estimated_num_physical_batches, split_logical_batch


class RecordingOptimizer:
    """Records signal_skip_step calls; step() counts real steps (those not signalled to skip)."""

    def __init__(self):
        self.signals = []
        self.steps = 0

    def signal_skip_step(self, do_skip):
        self.signals.append(do_skip)

    def step(self):
        if not self.signals[-1]:
            self.steps += 1


def index_dataset(n):
    return TensorDataset(torch.arange(n))


def run_epoch(physical_loader, optimizer):
    """Yield (indices, signal given just before this batch) pairs, as a training loop sees them."""
    seen = []
    for (indices,) in physical_loader:
        seen.append((indices.tolist(), optimizer.signals[-1]))
        optimizer.step()
    return seen


def group_by_logical(seen):
    groups, current = [], []
    for indices, skip in seen:
        current.extend(indices)
        if not skip:
            groups.append(current)
            current = []
    assert current == []  # the epoch ends on a step
    return groups


@pytest.mark.parametrize("max_physical", [1, 3, 8, 1000])
def test_splits_and_signals_once_per_logical_batch(max_physical):
    n, q, seed = 60, 0.15, 4
    loader = DPDataLoader(index_dataset(n), sample_rate=q, seed=seed)
    logical = list(PoissonBatchSampler(n, q, seed=seed))
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=max_physical, optimizer=optimizer) as phys:
        seen = run_epoch(phys, optimizer)
    assert all(len(indices) <= max_physical for indices, _ in seen)
    assert group_by_logical(seen) == logical
    assert optimizer.steps == len(logical) == len(loader)
    expected_signals = []
    for batch in logical:
        chunks = max(1, math.ceil(len(batch) / max_physical))
        expected_signals += [True] * (chunks - 1) + [False]
    assert optimizer.signals == expected_signals


def test_empty_logical_batches_give_one_empty_physical_batch():
    loader = DPDataLoader(TensorDataset(torch.randn(10, 3)), sample_rate=1e-9, steps=4, seed=0)
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as phys:
        batches = [batch for (batch,) in phys]
    assert [b.shape for b in batches] == [(0, 3)] * 4
    assert optimizer.signals == [False] * 4


def test_len_before_each_pass_is_exactly_what_the_pass_yields():
    """A progress bar built from len() ends at 100% in every epoch, although the count is random."""
    n, q, max_physical = 100, 0.1, 3
    loader = DPDataLoader(index_dataset(n), sample_rate=q, seed=1)
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=max_physical, optimizer=optimizer) as phys:
        counts = []
        for epoch in range(4):
            announced = len(phys)
            iterator = iter(phys)
            next(iterator)
            assert len(phys) == announced  # the pass under way
            counts.append(1 + sum(1 for _ in iterator))
            assert counts[-1] == announced
    assert len(set(counts)) > 1  # the count is random: an estimate would be wrong in some epoch
    # the same draws as without asking len(): planning early changes no draw
    untouched = DPDataLoader(index_dataset(n), sample_rate=q, seed=1)
    with BatchMemoryManager(data_loader=untouched, max_physical_batch_size=max_physical,
                            optimizer=RecordingOptimizer()) as phys:
        assert [sum(1 for _ in phys) for _ in range(4)] == counts


def test_plan_epoch_gives_exact_len_before_iterating_and_never_replays_an_epoch():
    loader = DPDataLoader(index_dataset(80), sample_rate=0.1, seed=2)
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as phys:
        phys.set_epoch(0)
        planned = phys.plan_epoch()
        assert len(phys) == planned
        phys.set_epoch(0)  # same epoch: keeps the plan
        assert planned == len(phys) == sum(1 for _ in phys)
        phys.set_epoch(1)
        first_pass_of_1 = [b[0].tolist() for b in phys]
        phys.set_epoch(1)  # a past epoch is never replayed (a reused batch would go unaccounted)
        phys.set_epoch(2)
        phys.set_epoch(1)
        second = [b[0].tolist() for b in phys]
    assert second != first_pass_of_1
    replay = DPDataLoader(index_dataset(80), sample_rate=0.1, seed=2)
    replay.set_epoch(2)  # the same seed gives the same epoch 2: a resumed run stays exact
    with BatchMemoryManager(data_loader=replay, max_physical_batch_size=2, optimizer=RecordingOptimizer()) as phys:
        assert [b[0].tolist() for b in phys] == second


def test_signals_stay_aligned_with_prefetching_workers():
    loader = DPDataLoader(index_dataset(40), sample_rate=0.2, seed=9, num_workers=1, prefetch_factor=4)
    logical = list(PoissonBatchSampler(40, 0.2, seed=9))
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as phys:
        seen = run_epoch(phys, optimizer)
    assert group_by_logical(seen) == logical


def test_works_with_fixed_size_loader_and_validates_arguments():
    loader = DataLoader(index_dataset(10), batch_size=4)
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as phys:
        assert len(phys) == 5  # [4, 4, 2] in chunks of at most 3
        seen = run_epoch(phys, optimizer)
        assert len(phys) == 5
    assert group_by_logical(seen) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=0, optimizer=optimizer)
    with pytest.raises(TypeError, match="signal_skip_step"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=object())


def test_split_helpers():
    assert split_logical_batch([], 4) == [[]]
    assert split_logical_batch([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert estimated_num_physical_batches(10, 0.0, 4) == 10
    assert estimated_num_physical_batches(10, 9.0, 4) == 30
