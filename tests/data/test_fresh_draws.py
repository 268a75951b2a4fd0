"""Every batch the Poisson loader yields is a fresh draw, whatever the iteration pattern; a
resumed loader continues exactly. (Before: a new iterator restarted the epoch with its seed, so
``next(iter(loader))`` in a loop gave the same batch every time.)"""

import io

import pytest
import torch
from torch.utils.data import TensorDataset

from dptorch.data import DPDataLoader, PoissonBatchSampler


def loader(seed=3, **kwargs):
    return DPDataLoader(TensorDataset(torch.arange(200)), sample_rate=0.1, seed=seed, **kwargs)  # 10 per epoch


def ids(batch):
    return tuple(batch[0].tolist())


def save_and_load(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_new_iterator_per_batch_draws_a_new_batch_each_time():
    dl = loader()
    batches = [ids(next(iter(dl))) for _ in range(20)]
    assert len(set(batches)) == 20  # was 1: the same first batch of epoch 0, twenty times
    assert dl.batch_sampler.position == 20 and dl.batch_sampler.epoch == 2


def test_partial_epochs_continue_the_epoch_instead_of_restarting_it():
    dl = loader()
    seen = []
    for i, batch in enumerate(dl):
        seen.append(ids(batch))
        if i == 2:
            break
    rest = [ids(b) for b in dl]  # the remaining 7 draws of epoch 0, not epoch 0 again
    assert len(rest) == 7
    full = [ids(b) for b in dl]
    assert len(full) == len(dl) == 10
    everything = seen + rest + full
    assert len(set(everything)) == len(everything) == 20
    # the stream is the same as one uninterrupted run with the same seed
    straight = loader()
    assert everything == [ids(b) for _ in range(2) for b in straight]


def test_several_live_iterators_share_one_stream_of_draws():
    dl = loader()
    a, b = iter(dl), iter(dl)
    drawn = []
    for _ in range(4):
        drawn += [ids(next(a)), ids(next(b))]
    assert len(set(drawn)) == 8
    tail_a, tail_b = [ids(x) for x in a], [ids(x) for x in b]  # both end at the epoch boundary
    assert len(tail_a) + len(tail_b) == 2
    assert len(set(drawn + tail_a + tail_b)) == 10


def test_set_epoch_never_goes_back():
    dl = loader()
    first = [ids(b) for b in dl]
    dl.set_epoch(0)  # a past epoch: no replay
    again = [ids(b) for b in dl]
    assert not set(first) & set(again)
    dl.set_epoch(5)  # forward: skipped draws are never drawn
    assert dl.batch_sampler.position == 50


@pytest.mark.parametrize("pattern", ["next_iter", "partial", "interleaved"])
def test_resume_continues_exactly_after_any_pattern(pattern):
    original = loader(seed=8)
    if pattern == "next_iter":
        for _ in range(13):
            next(iter(original))
    elif pattern == "partial":
        list(original)
        it = iter(original)
        for _ in range(3):
            next(it)
    else:
        a, b = iter(original), iter(original)
        for _ in range(3):
            next(a), next(b)
    state = save_and_load(original.state_dict())
    expected = [ids(next(iter(original))) for _ in range(12)]
    resumed = loader(seed=99)
    resumed.load_state_dict(state)
    assert [ids(next(iter(resumed))) for _ in range(12)] == expected


def test_batches_prefetched_by_workers_but_not_used_are_drawn_again_after_resume():
    original = loader(seed=4, num_workers=1, prefetch_factor=4)
    it = iter(original)
    head = [ids(next(it)) for _ in range(3)]
    state = original.state_dict()
    assert state["position"] == 3  # the sampler itself is ahead: the worker prefetched more
    assert original.batch_sampler.position > 3
    continued = [ids(next(it)) for _ in range(4)]
    resumed = loader(seed=0)
    resumed.load_state_dict(state)
    assert [ids(next(iter(resumed))) for _ in range(4)] == continued
    assert not set(head) & set(continued)


def test_secure_sampler_draws_from_the_csprng_and_keeps_only_its_position():
    torch.manual_seed(0)
    a = PoissonBatchSampler(500, 0.1, secure=True)
    torch.manual_seed(0)
    b = PoissonBatchSampler(500, 0.1, secure=True)
    assert list(a) != list(b)
    sizes = [len(batch) for batch in PoissonBatchSampler(500, 0.1, steps=300, secure=True)]
    assert abs(sum(sizes) / len(sizes) - 50) < 2.5  # Binomial(500, 0.1): mean 50, sd of the mean 0.4
    state = a.state_dict()
    assert state["seed"] == -1 and state["secure"] and state["position"] == 10
    with pytest.raises(ValueError, match="no seed or generator"):
        PoissonBatchSampler(500, 0.1, secure=True, seed=1)
    with pytest.raises(ValueError, match="secure"):
        PoissonBatchSampler(500, 0.1, seed=1).load_state_dict(state)
