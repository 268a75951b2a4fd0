"""The secure stream (dptorch/noise/secure.py): keystream offsets, fresh keys, exact conversions.

Statistical assertions sit at 6 standard deviations (two-sided false-failure probability about
2e-9 each); the no-repeat checks compare 64-bit keystream words, which two independent streams
share with probability below (2 * 10^5)^2 / 2^64 = 2e-9.
"""

import copy
import math
import multiprocessing
import os
import pickle

import numpy as np
import pytest
import torch

from dptorch.noise import SecureNoiseGenerator, gaussian, secure_bernoulli, secure_uniforms
from dptorch.noise.secure import CHUNK, KeyStream, bernoulli, box_muller, fill_normals, keystream_into, open_uniforms

WORDS = 100_000


class FixedStream(KeyStream):
    """A stream with a known key and counter, so one draw can be computed twice."""

    def __init__(self, key: bytes, counter: int):
        super().__init__()
        self._key, self._counter = key, counter


def words_of(stream: KeyStream) -> np.ndarray:
    return stream.words(WORDS)


def assert_disjoint(a: np.ndarray, b: np.ndarray) -> None:
    assert np.intersect1d(a, b).size == 0


def test_keystream_offsets_agree_with_one_long_stream_across_the_counter_wrap():
    key = bytes(range(32))
    start = (1 << 128) - 3  # the 128-bit counter wraps inside the draw
    whole = np.empty(40, dtype=np.uint64)
    keystream_into(key, start, whole)
    tail = np.empty(20, dtype=np.uint64)
    keystream_into(key, (start + 10) % (1 << 128), tail)  # 10 blocks = 20 words further on
    assert np.array_equal(whole[20:], tail)
    assert len(set(whole.tolist())) == 40
    # a draw longer than the zero plaintext is read through it in turns, continuing the counter
    long = np.empty(2 * CHUNK + 4, dtype=np.uint64)
    keystream_into(key, start, long)
    later = np.empty(4, dtype=np.uint64)
    keystream_into(key, (start + CHUNK) % (1 << 128), later)
    assert np.array_equal(long[:40], whole) and np.array_equal(long[2 * CHUNK :], later)


def test_reserved_ranges_never_overlap_and_a_large_draw_matches_its_pieces():
    key, counter = os.urandom(32), 12345
    stream = FixedStream(key, counter)
    first, second = stream.words(6), stream.words(5)
    expected = np.empty(12, dtype=np.uint64)
    keystream_into(key, counter, expected)
    assert np.array_equal(first, expected[:6]) and np.array_equal(second, expected[6:11])
    # float32 output is the float64 output rounded once, over several pieces and an odd tail
    count = 2 * (1 << 20) + 3
    wide, narrow = torch.empty(count, dtype=torch.float64), torch.empty(count, dtype=torch.float32)
    fill_normals(FixedStream(key, counter), wide, 1.7)
    fill_normals(FixedStream(key, counter), narrow, 1.7)
    assert torch.equal(narrow, wide.float())
    # with summands, too (the float64 sum is rounded once)
    summed_wide, summed_narrow = torch.empty(count, dtype=torch.float64), torch.empty(count, dtype=torch.float32)
    fill_normals(FixedStream(key, counter), summed_wide, 1.7, summands=2)
    fill_normals(FixedStream(key, counter), summed_narrow, 1.7, summands=2)
    assert torch.equal(summed_narrow, summed_wide.float())
    # a small summed draw is the scaled sum of consecutive normals of the stream's buffer
    summed = torch.empty(6, dtype=torch.float64)
    fill_normals(FixedStream(key, counter), summed, 2.0, summands=2)
    singles = torch.empty(12, dtype=torch.float64)
    fill_normals(FixedStream(key, counter), singles, 1.0)
    assert torch.equal(summed, (singles[:6] + singles[6:]) * (2.0 / math.sqrt(2)))
    # a small draw does not repeat the normals of the one before it
    stream = FixedStream(key, counter)
    small = [torch.empty(1000) for _ in range(3)]
    for tensor in small:
        fill_normals(stream, tensor, 1.0)
    assert not torch.equal(small[0], small[1]) and not torch.equal(small[1], small[2])
    reference = torch.from_numpy(stream_normals(key, counter, 3000)).float().double()
    # numpy or torch may make either (their last float64 bit may differ): at most one float32 step apart
    assert ((torch.cat(small).double() - reference).abs() <= reference.abs() * 2.0**-23).all()


def stream_normals(key: bytes, counter: int, count: int) -> np.ndarray:
    """The first ``count`` normals of a fresh stream's buffer (one large draw of its size)."""
    values = torch.empty(1 << 16, dtype=torch.float64)
    fill_normals(FixedStream(key, counter), values, 1.0)
    return values.numpy()[:count]


def test_uniforms_are_strictly_inside_the_unit_interval_and_box_muller_is_the_formula():
    edge = np.array([0, 2**64 - 1, 2**63], dtype=np.uint64)
    assert open_uniforms(edge.copy(), np.empty(3)).tolist() == [2.0**-53, 1 - 2.0**-53, 0.5 + 2.0**-53]
    radius_words = np.array([0, 2**64 - 1, 2**63], dtype=np.uint64)
    angle_words = np.array([2**63, 2**62, 0], dtype=np.uint64)
    u = np.array([2.0**-53, 1 - 2.0**-53, 0.5 + 2.0**-53])
    t = 2 * math.pi * (angle_words >> np.uint64(12)).astype(np.float64) * 2.0**-52
    r = 3.0 * np.sqrt(-2 * np.log(u))
    out = np.empty(6)
    box_muller(radius_words.copy(), angle_words.copy(), 3.0, out, np.empty(6))
    assert np.allclose(out, np.concatenate([r * np.cos(t), r * np.sin(t)]), rtol=1e-14, atol=1e-300)
    assert np.isfinite(out).all() and abs(out[0]) == pytest.approx(3.0 * math.sqrt(106 * math.log(2)))
    uniforms = secure_uniforms(WORDS)
    assert 0 < uniforms.min() and uniforms.max() < 1
    assert abs(uniforms.mean() - 0.5) < 6 * math.sqrt(1 / 12 / WORDS)


def test_bernoulli_uses_an_exact_threshold():
    stream = KeyStream()
    assert not bernoulli(stream, 1000, 0.0).any() and bernoulli(stream, 1000, 1.0).all()
    assert bernoulli(stream, 0, 0.5).shape == (0,)
    assert not secure_bernoulli(1000, 2.0**-40).any()  # P(any True) = 1000 * 2^-40, about 1e-9
    for p in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="probability"):
            secure_bernoulli(10, p)
    # P(True) = ceil(p 2^64) / 2^64: compare the words with the threshold by hand
    key, counter = os.urandom(32), 7
    p = 0.3
    drawn = bernoulli(FixedStream(key, counter), 1001, p)
    words = np.empty(1002, dtype=np.uint64)
    keystream_into(key, counter, words)
    assert np.array_equal(drawn, words[:1001] < np.uint64(math.ceil(p * 2**64)))
    count, n = int(secure_bernoulli(10**6, p).sum()), 10**6
    assert abs(count - n * p) < 6 * math.sqrt(n * p * (1 - p))


def test_every_generator_copy_and_resume_gets_a_fresh_key():
    a, b = SecureNoiseGenerator(), SecureNoiseGenerator()
    first = words_of(a.stream)
    assert_disjoint(first, words_of(b.stream))
    # a copy (deepcopy of an optimizer, pickling to another process) never shares the key
    assert_disjoint(first, words_of(copy.deepcopy(a).stream))
    blob = pickle.dumps(a)
    assert a.stream._key not in blob
    assert_disjoint(first, words_of(pickle.loads(blob).stream))
    # a resume: the checkpoint holds nothing, and the resumed generator draws from a new key
    state = a.state_dict()
    assert state == {}
    resumed = SecureNoiseGenerator()
    resumed.load_state_dict(state)
    assert_disjoint(np.concatenate([first, words_of(a.stream)]), words_of(resumed.stream))
    noise = [g.noise_like(torch.empty(WORDS), 1.0) for g in (a, resumed)]
    assert (noise[0] != noise[1]).float().mean() > 0.999


def _child_words(pipe) -> None:
    pipe.send((gaussian._STREAM.words(WORDS), os.getpid()))
    pipe.close()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_process_never_continues_its_parents_stream():
    gaussian._STREAM.words(1)  # the parent's stream is in use before the fork
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child_words, args=(sender,))
    with gaussian._STREAM._lock:  # as if another thread were drawing at the fork: the child must not wait on it
        child.start()
    if not receiver.poll(60):
        child.terminate()
        pytest.fail("the forked child never drew: it waited on the lock its parent held at the fork")
    child_words, child_pid = receiver.recv()
    child.join(timeout=60)
    assert child.exitcode == 0 and child_pid != os.getpid()
    assert_disjoint(gaussian._STREAM.words(WORDS), child_words)
