"""The plan of ``dptorch.distributed.partitions`` (one process, no collective): the reduce-scatter buckets cover every
column of every rank's partition of every flat space once, within the bucket bound; each bucket forms the clipped sums
of exactly the parameters with elements in its columns on some rank; every parameter element is owned by one rank."""

import pytest
import torch
from torch import nn

from dptorch.distributed import partitions
from dptorch.distributed.partitions import FlatSpace


def flat_space(numels, gaps, world):
    """Parameters of ``numels`` side by side, ``gaps`` elements of padding after each, the whole padded to a multiple
    of ``2 * world`` as ZeRO-1/2 pads its groups."""
    offsets, at = [], 0
    for numel, gap in zip(numels, gaps):
        offsets.append(at)
        at += numel + gap
    size = -(-at // (2 * world)) * 2
    params = tuple(nn.Parameter(torch.zeros(numel)) for numel in numels)
    return FlatSpace(size=size, params=params, offsets=tuple(offsets), numels=tuple(numels), device=torch.device("cpu"))


def spaces_for(world):
    return [flat_space([15, 3, 3, 3, 6, 2], [0, 1, 0, 0, 0, 0], world), flat_space([5], [0], world),
            flat_space([40, 1], [0, 0], world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [1, 7, 16, 1 << 24])
def test_buckets_cover_every_column_of_every_partition_once_within_the_bound(world, bucket, monkeypatch):
    monkeypatch.setattr(partitions, "BUCKET", bucket)
    spaces = spaces_for(world)
    seen = {index: [] for index in range(len(spaces))}
    for windows in partitions._buckets(spaces, world):
        columns = 0
        for index, start, end, column in windows:
            assert column == columns and end > start  # side by side in the row
            seen[index] += range(start, end)
            columns += end - start
        assert columns <= max(1, bucket // world)
    assert all(seen[index] == list(range(space.size)) for index, space in enumerate(spaces))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [1, 7, 16])
def test_a_bucket_needs_exactly_the_parameters_with_elements_in_its_columns(world, bucket, monkeypatch):
    monkeypatch.setattr(partitions, "BUCKET", bucket)
    spaces = spaces_for(world)
    for windows in partitions._buckets(spaces, world):
        expected = set()
        for index, start, end, _ in windows:
            space = spaces[index]
            for param, (offset, numel) in enumerate(zip(space.offsets, space.numels)):
                if any(start <= (offset + element) % space.size < end for element in range(numel)):
                    expected.add((index, param))
        assert set(partitions._needed(spaces, windows, world)) == expected


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_parameter_element_is_owned_by_exactly_one_rank_where_its_flat_position_lies(world):
    for space in spaces_for(world):
        for index, (offset, numel) in enumerate(zip(space.offsets, space.numels)):
            owners = {}
            for rank in range(world):
                first, last = space.owned(index, rank)
                for element in range(first, last):
                    assert element not in owners
                    owners[element] = rank
            assert owners == {element: (offset + element) // space.size for element in range(numel)}
