import io
import os
import tempfile
from collections import namedtuple

import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset

from dptorch.data import DPDataLoader, PoissonBatchSampler, empty_batch_like
from dptorch.data.poisson import EmptyBatchCollate, epoch_seed


def binomial_fit_pvalue(sizes, n, q):
    """Chi-square goodness of fit of batch sizes to Binomial(n, q), bins pooled to E >= 5."""
    sizes = np.asarray(sizes)
    support = np.arange(n + 1)
    expected = stats.binom.pmf(support, n, q) * len(sizes)
    observed = np.bincount(sizes, minlength=n + 1)[: n + 1]
    edges, acc = [], 0.0
    for k in support:  # close a bin whenever it holds >= 5 expected counts
        acc += expected[k]
        if acc >= 5:
            edges.append(k)
            acc = 0.0
    edges[-1] = n
    bins_obs, bins_exp, start = [], [], 0
    for end in edges:
        bins_obs.append(observed[start : end + 1].sum())
        bins_exp.append(expected[start : end + 1].sum())
        start = end + 1
    bins_exp = np.asarray(bins_exp) * len(sizes) / np.sum(bins_exp)
    return stats.chisquare(bins_obs, bins_exp).pvalue


def save_and_load(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --- batch size law -------------------------------------------------------------------------


def test_batch_sizes_follow_binomial():
    n, q, steps = 400, 0.05, 3000
    sampler = PoissonBatchSampler(n, q, steps=steps, seed=123)
    batches = list(sampler)
    sizes = [len(b) for b in batches]
    assert len(batches) == steps
    assert binomial_fit_pvalue(sizes, n, q) > 1e-3
    mean, var = np.mean(sizes), np.var(sizes, ddof=1)
    assert abs(mean - n * q) < 5 * np.sqrt(n * q * (1 - q) / steps)
    assert abs(var - n * q * (1 - q)) < 5 * n * q * (1 - q) * np.sqrt(2 / (steps - 1))
    # each index included with probability q, no duplicates, valid range
    counts = np.bincount(np.concatenate([np.asarray(b, dtype=int) for b in batches]), minlength=n)
    assert all(len(set(b)) == len(b) and all(0 <= i < n for i in b) for b in batches)
    assert stats.chisquare(counts, np.full(n, counts.sum() / n)).pvalue > 1e-4


def test_binomial_check_rejects_fixed_size_and_wrong_rate():
    n, q, steps = 400, 0.05, 3000
    assert binomial_fit_pvalue([int(n * q)] * steps, n, q) < 1e-10
    rng = np.random.default_rng(0)  # right mean, wrong variance (uniform sizes 10..30)
    assert binomial_fit_pvalue(rng.integers(10, 31, steps), n, q) < 1e-10
    wrong_rate = [len(b) for b in PoissonBatchSampler(n, 0.055, steps=steps, seed=1)]
    assert binomial_fit_pvalue(wrong_rate, n, q) < 1e-3


def test_len_and_exact_number_of_batches():
    sampler = PoissonBatchSampler(10, 0.3)
    assert len(sampler) == round(1 / 0.3) == len(list(sampler))
    loader = DPDataLoader(TensorDataset(torch.arange(10.0)), sample_rate=1e-6, steps=7, seed=0)
    batches = list(loader)
    assert len(loader) == 7 and len(batches) == 7
    assert all(b[0].shape == (0,) for b in batches)
    assert len(DPDataLoader(TensorDataset(torch.arange(10.0)), sample_rate=0.01)) == 100


def test_no_sampler_attribute_and_vectorised_draw():
    sampler = PoissonBatchSampler(10, 0.5, seed=0)
    assert not hasattr(sampler, "sampler")
    generator = torch.Generator().manual_seed(epoch_seed(0, 0))
    expected = (torch.rand(10, generator=generator) < 0.5).nonzero().flatten().tolist()
    assert next(iter(sampler)) == expected


def test_invalid_arguments():
    for kwargs in ({"num_samples": 0, "sample_rate": 0.1}, {"num_samples": 5, "sample_rate": 0.0},
                   {"num_samples": 5, "sample_rate": 1.5}):
        with pytest.raises(ValueError):
            PoissonBatchSampler(**kwargs)
    with pytest.raises(TypeError, match="batch_size"):
        DPDataLoader(TensorDataset(torch.arange(4.0)), sample_rate=0.5, batch_size=2)


# --- empty batches keep structure -----------------------------------------------------------


class DictDataset(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {
            "input_ids": torch.arange(5) + i,
            "attention_mask": torch.ones(5, dtype=torch.bool),
            "labels": i,
            "pixel": torch.randn(3, 2, 2, dtype=torch.float16),
        }


class NestedDataset(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"a": {"b": torch.full((2,), float(i))}, "c": [torch.tensor(i), np.ones(3, dtype=np.float32)],
                "text": f"sample {i}"}


Pair = namedtuple("Pair", "x y")


class NamedTupleDataset(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return Pair(torch.randn(4), torch.tensor(i))


def assert_same_structure(empty, full):
    if isinstance(full, torch.Tensor):
        assert isinstance(empty, torch.Tensor)
        assert empty.shape == (0, *full.shape[1:]) and empty.dtype == full.dtype
    elif isinstance(full, dict):
        assert type(empty) is type(full) and empty.keys() == full.keys()
        for key in full:
            assert_same_structure(empty[key], full[key])
    elif isinstance(full, (list, tuple)):
        assert type(empty) is type(full)
        if all(isinstance(item, str) for item in full):
            assert len(empty) == 0
        else:
            assert len(empty) == len(full)
            for e, f in zip(empty, full):
                assert_same_structure(e, f)
    else:
        raise AssertionError(f"unexpected leaf {type(full)}")


@pytest.mark.parametrize(
    "dataset",
    [
        torch.randn(6, 3, 2),
        TensorDataset(torch.randn(6, 3), torch.arange(6)),
        DictDataset(),
        NestedDataset(),
        NamedTupleDataset(),
    ],
    ids=["tensor", "tuple", "dict", "nested", "namedtuple"],
)
def test_empty_batches_keep_structure(dataset):
    empty_loader = DPDataLoader(dataset, sample_rate=1e-9, steps=3, seed=0)
    full_loader = DPDataLoader(dataset, sample_rate=1.0, steps=1, seed=0)
    full = next(iter(full_loader))
    empties = list(empty_loader)
    assert len(empties) == 3
    for empty in empties:
        assert_same_structure(empty, full)


def test_empty_batch_is_fresh_each_time_and_custom_collate():
    def pad_collate(samples):
        length = max(len(s) for s in samples)
        return {"ids": torch.stack([torch.nn.functional.pad(s, (0, length - len(s))) for s in samples])}

    dataset = [torch.arange(i + 1) for i in range(5)]
    loader = DPDataLoader(dataset, sample_rate=1e-9, steps=2, collate_fn=pad_collate, seed=0)
    first, second = list(loader)
    assert first["ids"].shape == (0, 1) and first["ids"].dtype == torch.int64
    first.pop("ids")
    assert "ids" in second
    assert isinstance(loader.collate_fn, EmptyBatchCollate) and loader.collate_fn.collate_fn is pad_collate


def test_empty_batch_like_numpy_and_plain_leaves():
    batch = {"x": np.zeros((2, 3), dtype=np.int16), "names": ["a", "b"], "n": 7}
    empty = empty_batch_like(batch)
    assert empty["x"].shape == (0, 3) and empty["x"].dtype == np.int16
    assert empty["names"] == [] and empty["n"] == 7


# --- map-style only, from_data_loader -------------------------------------------------------


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_iterable_dataset_is_rejected_with_explanation():
    with pytest.raises(ValueError, match="map-style"):
        DPDataLoader(Stream(), sample_rate=0.1)
    with pytest.raises(ValueError, match="random access"):
        DPDataLoader.from_data_loader(DataLoader(Stream(), batch_size=2))


def my_collate(samples):
    return torch.stack(samples) * 2


def my_worker_init(worker_id):
    pass


def test_from_data_loader_keeps_settings_and_rate():
    dataset = [torch.full((2,), float(i)) for i in range(50)]
    source = DataLoader(dataset, batch_size=10, shuffle=True, collate_fn=my_collate, num_workers=1,
                        pin_memory=False, worker_init_fn=my_worker_init, prefetch_factor=3, timeout=30)
    loader = DPDataLoader.from_data_loader(source, generator=torch.Generator().manual_seed(0))
    assert loader.sample_rate == pytest.approx(1 / 5) and len(loader) == 5
    assert loader.dataset is dataset
    assert loader.collate_fn.collate_fn is my_collate
    assert loader.num_workers == 1 and loader.worker_init_fn is my_worker_init
    assert loader.prefetch_factor == 3 and loader.timeout == 30
    assert loader.world_size == 1
    batches = list(loader)
    assert len(batches) == 5
    assert all(torch.all(b[:, 0] % 2 == 0) for b in batches)  # my_collate doubled the values


def test_from_data_loader_errors():
    dataset = TensorDataset(torch.arange(8.0))
    with pytest.raises(ValueError, match="batch_size=None"):
        DPDataLoader.from_data_loader(DataLoader(dataset, batch_size=None))

    class EndlessSampler(Sampler):
        def __iter__(self):
            return iter(range(8))

    with pytest.raises(ValueError, match="no length"):
        DPDataLoader.from_data_loader(DataLoader(dataset, batch_size=2, sampler=EndlessSampler()))


# --- replay: set_epoch, state_dict ----------------------------------------------------------


def test_set_epoch_is_idempotent_and_deterministic():
    a = PoissonBatchSampler(100, 0.1, seed=7)
    a.set_epoch(3)
    a.set_epoch(3)
    b = PoissonBatchSampler(100, 0.1, seed=7)
    b.set_epoch(3)
    epoch3 = list(a)
    assert epoch3 == list(b)
    b.set_epoch(4)
    assert list(b) != epoch3
    c = PoissonBatchSampler(100, 0.1, seed=7)
    c.set_epoch(3)
    c.set_epoch(3)
    assert list(c) == epoch3


def test_completed_pass_advances_epoch():
    sampler = PoissonBatchSampler(100, 0.1, seed=7)
    first = list(sampler)
    assert sampler.epoch == 1
    sampler.set_epoch(1)  # the trainer's call for the next epoch is a no-op
    second = list(sampler)
    assert first != second
    replay = PoissonBatchSampler(100, 0.1, seed=7)
    replay.set_epoch(1)
    assert list(replay) == second


@pytest.mark.parametrize("mode", ["seed", "generator"])
@pytest.mark.parametrize("consumed", [0, 4, 10])
def test_state_dict_resume_draws_same_batches(mode, consumed):
    def make():
        if mode == "seed":
            return PoissonBatchSampler(200, 0.1, seed=11)
        return PoissonBatchSampler(200, 0.1, generator=torch.Generator().manual_seed(11))

    original = make()
    list(original)  # finish epoch 0 so the state is not the initial one
    iterator = iter(original)
    head = [next(iterator) for _ in range(consumed)]
    state = save_and_load(original.state_dict())
    tail = list(iterator)
    next_epoch = list(original)

    resumed = PoissonBatchSampler(200, 0.1, seed=999)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])  # trainers call this again on resume: must not reset
    if tail:  # (all 10 consumed: the saved position is the next epoch's start, and so is the resume)
        assert list(resumed) == tail
    assert list(resumed) == next_epoch


def test_loader_state_dict_round_trip():
    dataset = TensorDataset(torch.arange(30.0))
    loader = DPDataLoader(dataset, sample_rate=0.2, seed=5)
    state = save_and_load(loader.state_dict())
    expected = [b[0].tolist() for b in loader]
    other = DPDataLoader(dataset, sample_rate=0.2, seed=6)
    other.load_state_dict(state)
    assert [b[0].tolist() for b in other] == expected
    with pytest.raises(ValueError, match="num_samples"):
        PoissonBatchSampler(31, 0.2).load_state_dict(state)


# --- distributed ----------------------------------------------------------------------------


def test_rank_shards_partition_the_global_poisson_batch():
    world = 3
    global_batches = list(PoissonBatchSampler(50, 0.2, seed=3))
    shards = [list(PoissonBatchSampler(50, 0.2, seed=3, rank=r, world_size=world)) for r in range(world)]
    for step, batch in enumerate(global_batches):
        parts = [shards[r][step] for r in range(world)]
        assert all(i % world == r for r, part in enumerate(parts) for i in part)
        assert sorted(i for part in parts for i in part) == batch
    assert PoissonBatchSampler(50, 0.2, rank=1, world_size=3).expected_batch_size == pytest.approx(0.2 * 17)


def test_distributed_loader_needs_process_group_and_exposes_world_size():
    import torch.distributed as dist

    dataset = TensorDataset(torch.arange(20.0))
    with pytest.raises(ValueError, match="initialised"):
        DPDataLoader(dataset, sample_rate=0.1, distributed=True)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            loader = DPDataLoader.from_data_loader(DataLoader(dataset, batch_size=4), distributed=True)
            assert loader.world_size == 1 and loader.distributed and len(list(loader)) == 5
        finally:
            dist.destroy_process_group()
