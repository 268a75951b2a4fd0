"""The static-shape samplers draw what their events assume: a Poisson draw cut to B by a uniformly random subset,
or a uniformly random subset of exactly b; draws are fresh and resumable; secure mode draws from the secure
stream; padded batches keep their padding rows last whatever the collate function does."""

import collections
import io

import pytest
import torch
from torch.utils.data import TensorDataset

import dptorch.data.fixed_size as fixed_size_module
import dptorch.data.truncated_poisson as truncated_module
from dptorch.data import FixedSizeBatchSampler, PoissonBatchSampler, TruncatedPoissonBatchSampler
from dptorch.data.truncated_poisson import PaddedCollate, join_rows

N = 30


def test_a_truncated_draw_is_the_poisson_draw_cut_to_a_uniformly_random_subset():
    truncated = TruncatedPoissonBatchSampler(N, 0.5, max_batch_size=5, seed=2)
    poisson = PoissonBatchSampler(N, 0.5, seed=2)  # the same inclusion bits for the same (seed, position)
    drawn, kept = collections.Counter(), collections.Counter()
    draws = 2000
    for _ in range(draws):
        full, cut = poisson.draw()[1], truncated.draw()[1]
        assert len(cut) == min(len(full), 5) and set(cut) <= set(full)
        if len(full) > 5:
            drawn.update(full)
            kept.update(cut)
    # each drawn index is kept with the same chance, whatever its place in the draw (E[5 / |draw|] ~ 0.34)
    rates = [kept[i] / drawn[i] for i in range(N)]
    mean = sum(kept.values()) / sum(drawn.values())
    assert max(abs(r - mean) for r in rates) < 0.06, rates


def test_a_fixed_size_draw_is_a_uniformly_random_subset_of_exactly_b():
    sampler = FixedSizeBatchSampler(N, 6, seed=3)
    counts = collections.Counter()
    overlaps = 0
    previous: set = set()
    for _ in range(3000):
        batch = sampler.draw()[1]
        assert len(batch) == len(set(batch)) == 6 and batch == sorted(batch)
        counts.update(batch)
        overlaps += bool(previous & set(batch))
        previous = set(batch)
    assert max(abs(counts[i] / 3000 - 6 / N) for i in range(N)) < 0.025
    assert overlaps > 0  # draws are independent: a sample may be in consecutive batches
    assert len(sampler) == round(N / 6) and sampler.expected_batch_size == 6.0


@pytest.mark.parametrize("make", [lambda **o: TruncatedPoissonBatchSampler(N, 0.4, max_batch_size=7, **o),
                                  lambda **o: FixedSizeBatchSampler(N, 7, **o)])
def test_a_resumed_sampler_continues_with_the_very_draws_of_the_uninterrupted_one(make):
    straight = make(seed=5)
    expected = [straight.draw()[1] for _ in range(9)]
    first = make(seed=5)
    for _ in range(4):
        first.hand_out(first.draw()[0])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make(seed=77)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert [resumed.draw()[1] for _ in range(5)] == expected[4:]


def test_resuming_with_another_batch_bound_is_refused():
    state = TruncatedPoissonBatchSampler(N, 0.4, max_batch_size=7, seed=5).state_dict()
    with pytest.raises(ValueError, match="max_batch_size"):
        TruncatedPoissonBatchSampler(N, 0.4, max_batch_size=8, seed=5).load_state_dict(state)
    state = FixedSizeBatchSampler(N, 7, seed=5).state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        FixedSizeBatchSampler(N, 6, seed=5).load_state_dict(state)


def test_secure_samplers_take_the_subset_from_the_secure_stream_and_ignore_torchs_seed(monkeypatch):
    calls = []
    for module in (truncated_module, fixed_size_module):
        original = module.secure_subset
        monkeypatch.setattr(module, "secure_subset", lambda n, k, f=original: calls.append((n, k)) or f(n, k))
    torch.manual_seed(0)
    a = [TruncatedPoissonBatchSampler(N, 0.9, max_batch_size=5, secure=True).draw()[1] for _ in range(3)]
    b = [FixedSizeBatchSampler(N, 5, secure=True).draw()[1] for _ in range(3)]
    torch.manual_seed(0)
    a2 = [TruncatedPoissonBatchSampler(N, 0.9, max_batch_size=5, secure=True).draw()[1] for _ in range(3)]
    b2 = [FixedSizeBatchSampler(N, 5, secure=True).draw()[1] for _ in range(3)]
    assert a != a2 and b != b2  # 3 draws of 5 of 30 twice alike: about 1e-16
    assert sum(k == 5 and n >= 5 for n, k in calls) == 12  # every truncation (q 0.9: always) and every subset
    with pytest.raises(ValueError, match="no seed or generator"):
        FixedSizeBatchSampler(N, 5, secure=True, seed=1)


def test_padding_rows_come_last_whatever_order_the_collate_function_gives_the_real_rows():
    data = TensorDataset(torch.arange(10.0).reshape(10, 1) + 1)  # row 0 holds 1.0

    def reversing(samples):
        return torch.stack([s[0] for s in reversed(samples)])

    collate = PaddedCollate.for_dataset(data, reversing, rows=6)
    batch = collate([data[4], data[7], data[2]])
    assert batch.flatten().tolist() == [3.0, 8.0, 5.0, 1.0, 1.0, 1.0]
    assert collate([]).flatten().tolist() == [1.0] * 6
    assert collate([data[i] for i in range(6)]).shape == (6, 1)
    with pytest.raises(ValueError, match="7 samples for a padded batch of 6"):
        collate([data[0]] * 7)


def test_join_rows_joins_each_item_and_refuses_shapes_that_differ_beyond_the_rows():
    Pair = collections.namedtuple("Pair", "x y")
    first = {"ids": torch.zeros(2, 3), "pair": Pair(torch.ones(2), ["a", "b"])}
    second = {"ids": torch.ones(1, 3), "pair": Pair(torch.zeros(1), ["pad"])}
    joined = join_rows(first, second)
    assert joined["ids"].shape == (3, 3) and joined["pair"].y == ["a", "b", "pad"]
    assert isinstance(joined["pair"], Pair) and joined["pair"].x.tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="pad sequences to a fixed length"):
        join_rows(torch.zeros(2, 5), torch.zeros(1, 7))
    with pytest.raises(ValueError, match="cannot join"):
        join_rows({"a": torch.zeros(1)}, {"b": torch.zeros(1)})
