"""Secure-mode ShardedNoise (FSDP2): each rank draws its slice from its own secure stream.

In one process, one ``ShardedNoise`` per simulated rank stands for the ranks' processes (each has
its own ``SecureNoiseGenerator``, as each process would). Moment checks sit at 6 standard
deviations (false failure about 2e-9); the no-repeat check compares 64-bit keystream words.
"""

import math
import os

import numpy as np
import torch

from dptorch.distributed import ShardedNoise
from dptorch.noise import SecureNoiseGenerator
from dptorch.noise.secure import KeyStream, fill_normals


def test_secure_slices_come_from_each_ranks_own_stream_and_cover_the_parameter():
    numel, std = 400_001, 1.5
    ranks = [ShardedNoise(SecureNoiseGenerator(), chunk_size=997) for _ in range(2)]
    assert all(rank.secure and rank.step_key() is None and rank.state_dict() == {} for rank in ranks)
    bounds = [(0, 200_000), (200_000, numel)]
    slices = [rank.slice(rank.step_key(), 3, numel, start, end, std) for rank, (start, end) in zip(ranks, bounds)]
    assert [piece.numel() for piece in slices] == [end - start for start, end in bounds]
    assert all(piece.dtype == torch.float32 for piece in slices)
    values = torch.cat(slices).double() / std
    assert abs(values.mean().item()) < 6 / math.sqrt(numel)
    assert abs(values.std().item() - 1) < 6 / math.sqrt(2 * numel)
    first, second = (rank.base.stream.words(100_000) for rank in ranks)
    assert np.intersect1d(first, second).size == 0
    assert ranks[0].slice(None, 0, 10, 4, 4, std).numel() == 0
    assert ranks[0].slice(None, 0, 10, 0, 10, std, dtype=torch.float64).dtype == torch.float64


def test_a_secure_slice_is_the_base_generators_draw():
    key = os.urandom(32)
    base = SecureNoiseGenerator()
    base.stream._key, base.stream._counter = key, 99
    reference = KeyStream()
    reference._key, reference._counter = key, 99
    expected = torch.empty(1234)
    fill_normals(reference, expected, 0.5)
    assert torch.equal(ShardedNoise(base).slice(None, 7, 5000, 100, 1334, 0.5), expected)
