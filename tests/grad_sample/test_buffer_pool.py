"""Per-sample gradient memory is lent again each round, but never while anything else holds it."""

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.modes.buffers import BufferPool
from dptorch.optim import DPOptimizer
from tests.grad_sample.test_shared_inputs import TiedLM
from tests.helpers import projection_loss, reference_per_sample_grads


def lend_and_drop(pool, shape=(4, 5)):
    """Lend a tensor, fill it, drop it; returns its address."""
    lent = pool.empty(shape, torch.float32, "cpu")
    lent.fill_(1.0)
    return lent.data_ptr()


def test_a_dropped_block_is_lent_again_and_a_larger_request_gets_new_memory():
    pool = BufferPool()
    address = lend_and_drop(pool, (4, 5))
    pool.reclaim()
    smaller = pool.empty((3, 5), torch.float32, "cpu")
    assert smaller.data_ptr() == address and smaller.shape == (3, 5) and smaller.is_contiguous()
    assert pool.empty((40, 50), torch.float32, "cpu").data_ptr() != address  # nothing free holds it
    assert pool.empty((4, 5), torch.float64, "cpu").data_ptr() != address  # another dtype


def test_an_outgrown_block_is_let_go_when_its_successor_is_made():
    """A larger Poisson batch outgrows last round's block: the pool lets go of it then, rather than holding
    it beside the new one for the whole round; a block of another dtype or one still large enough stays."""
    pool = BufferPool()
    for shape, dtype in [((4, 5), torch.float32), ((40, 5), torch.float32), ((4, 5), torch.float64)]:
        pool.empty(shape, dtype, "cpu")
    pool.reclaim()
    assert sorted((b.numel(), b.dtype == torch.float32) for b in pool._free) == [(25, False), (25, True), (250, True)]
    pool.empty((8, 5), torch.float32, "cpu")  # fits the 250: nothing let go
    pool.empty((9, 5), torch.float32, "cpu")  # fits nothing free: the 25 (float32) is let go
    assert sorted((b.numel(), b.dtype == torch.float32) for b in pool._free) == [(25, False)]


@pytest.mark.parametrize("keep", [
    lambda t: t,  # the tensor itself
    lambda t: t[1],  # a view of it
    lambda t: t.untyped_storage(),  # its storage object
    lambda t: t.numpy(),  # an array on its memory
])
def test_a_block_anything_else_refers_to_is_never_lent_again(keep):
    pool = BufferPool()
    lent = pool.empty((4, 5), torch.float32, "cpu")
    lent.copy_(torch.arange(20.0).view(4, 5))
    kept = keep(lent)
    address = lent.data_ptr()
    del lent
    pool.reclaim()
    again = pool.empty((4, 5), torch.float32, "cpu")
    again.fill_(-1.0)
    assert again.data_ptr() != address
    original = torch.arange(20.0).view(4, 5)
    if isinstance(kept, torch.UntypedStorage):
        assert torch.equal(torch.tensor([], dtype=torch.float32).set_(kept)[:20].view(4, 5), original)
    else:
        assert torch.equal(torch.as_tensor(kept), torch.as_tensor(keep(original)))


def test_a_reclaim_after_a_round_that_lent_nothing_keeps_the_free_blocks():
    pool = BufferPool()
    address = lend_and_drop(pool)
    pool.reclaim()
    pool.reclaim()  # e.g. zero_grad twice, no backward in between
    assert pool.empty((4, 5), torch.float32, "cpu").data_ptr() == address


def test_off_the_cpu_the_pool_only_allocates():
    pool = BufferPool()
    lent = pool.empty((4, 5), torch.float32, "meta")
    assert lent.device.type == "meta" and lent.shape == (4, 5)
    del lent
    pool.reclaim()
    assert pool.empty((4, 5), torch.float32, "cpu").device.type == "cpu"


def mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("tied", [True, False])
def test_rounds_of_varying_batch_size_in_reused_memory_match_the_batch_of_one_reference(tied):
    torch.manual_seed(0)
    model = TiedLM(11, 6, None)
    if not tied:  # the embedding's rows then go into zeroed pool memory of their own
        model.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    weights = {model.emb.weight, model.mix.weight, model.head.weight}  # biases are not pooled
    batches = [torch.randint(0, 11, (batch, 7)) for batch in (5, 3, 4, 5)]  # Poisson-like sizes
    references = [reference_per_sample_grads(model, (ids,), projection_loss) for ids in batches]
    addresses = []
    with GradSampleHooks(model) as hooks:
        for ids, want in zip(batches, references):
            hooks.clear()
            model.zero_grad()
            projection_loss(model(ids)).mean().backward()
            got = hooks.grad_samples
            for p, expected in want.items():
                torch.testing.assert_close(got[p], expected, rtol=1e-4, atol=1e-6)
            addresses.append({got[p].data_ptr() for p in weights})
            del got
    assert addresses[1] <= addresses[0] and addresses[2] <= addresses[0]  # the same memory again


def test_a_kept_grad_sample_survives_later_rounds():
    torch.manual_seed(0)
    model = mlp()
    with GradSampleHooks(model) as hooks:
        projection_loss(model(torch.randn(5, 6))).mean().backward()
        weight = model[0].weight
        kept, kept_row = weight.grad_sample, weight.grad_sample[2]
        saved = kept.clone()
        for _ in range(2):
            hooks.clear()
            projection_loss(model(torch.randn(5, 6))).mean().backward()
            assert not torch.equal(weight.grad_sample, saved)
        assert torch.equal(kept, saved) and torch.equal(kept_row, saved[2])


@pytest.mark.parametrize("zero_grad", [True, False])
def test_the_dp_optimizer_step_hands_the_memory_back(zero_grad):
    """Nothing in a private step keeps the per-sample gradients past the next forward (p.grad_sample
    stays readable until then): the next round reuses their memory, with or without zero_grad()."""
    torch.manual_seed(0)
    model = mlp()
    hooks = GradSampleHooks(model, keep_param_grads=False)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=5)
    addresses = []
    try:
        for _ in range(3):
            if zero_grad:
                optimizer.zero_grad()
            projection_loss(model(torch.randn(5, 6))).mean().backward()
            addresses.append(model[2].weight.grad_sample.data_ptr())
            optimizer.step()
    finally:
        hooks.cleanup()
    assert addresses[0] == addresses[1] == addresses[2]


@pytest.mark.parametrize("in_by_out", [False, True])
def test_lent_memory_holding_nan_is_only_written(in_by_out):
    """The per-sample matmul writes its memory with beta=0: whatever a reused block held is never read."""
    from dptorch.grad_sample.layers.linear import linear_map_grad_samples

    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    weight = nn.Parameter(layer.weight.detach().t().contiguous()) if in_by_out else layer.weight
    x, g = torch.randn(3, 5, 6), torch.randn(3, 5, 4)
    nan_memory = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    got = linear_map_grad_samples(weight, layer.bias, x, g, in_by_out, empty=nan_memory, scale=3.0)
    want = linear_map_grad_samples(weight, layer.bias, x, g * 3.0, in_by_out)
    for p in (weight, layer.bias):
        torch.testing.assert_close(got[p], want[p])
