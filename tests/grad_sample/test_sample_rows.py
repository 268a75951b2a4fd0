"""``embedding.SampleRows``: each (sample, row) pair of a batch of ids gets one slot, the tokens of the pair (one
sample's) are summed into it, and the slots' number is fixed by the shapes alone (``B min(T, rows)``), so that a
trace of the step holds it; empty slots add exactly 0."""

import pytest
import torch

from dptorch.grad_sample.layers.embedding import SampleRows


@pytest.mark.parametrize("rows", [3, 50])
def test_each_pair_sums_its_own_tokens_in_slots_of_a_fixed_number(rows):
    generator = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, rows, (4, 6), generator=generator)
    ids[1] = ids[1, 0]  # one sample's tokens all on one row
    values = torch.randn(ids.numel(), 5, generator=generator, dtype=torch.float64)
    pairs = SampleRows(ids, rows)
    assert pairs.row.shape == pairs.sample.shape == (4 * min(6, rows),)
    summed = pairs.sum(values)
    want = {}
    for index, (sample, row) in enumerate((s, int(r)) for s in range(4) for r in ids[s]):
        want[sample, row] = want.get((sample, row), 0) + values[index]
    found = {}
    for slot in range(len(pairs.row)):
        key = (int(pairs.sample[slot]), int(pairs.row[slot]))
        if key in want and key not in found:
            found[key] = summed[slot]
        else:  # an empty slot past the pairs
            assert torch.equal(summed[slot], torch.zeros(5, dtype=torch.float64))
    assert found.keys() == want.keys()
    for key, total in want.items():
        torch.testing.assert_close(found[key], total, rtol=0, atol=1e-12)


def test_an_empty_batch_has_no_slot():
    pairs = SampleRows(torch.zeros(0, 4, dtype=torch.long), 10)
    assert pairs.row.numel() == 0 and pairs.sum(torch.zeros(0, 3)).shape == (0, 3)


def test_ids_beyond_the_rows_given_never_share_a_slot_across_samples():
    """A table smaller than the ids (a shard's rows, say): each sample's ids are grouped on their own, so no slot
    mixes two samples; more pairs than the slots raise rather than fold pairs together."""
    ids = torch.tensor([[7, 0, 7, 1], [0, 7, 1, 7]])
    pairs = SampleRows(ids, 3)  # ids up to 7; 3 pairs per sample fit the 2 * 3 slots
    assert sorted(zip(pairs.sample.tolist(), pairs.row.tolist())) == [(0, 0), (0, 1), (0, 7), (1, 0), (1, 1), (1, 7)]
    with pytest.raises(RuntimeError, match="out of bounds"):
        SampleRows(torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]), 3)  # 8 pairs, 6 slots
