"""Linear layers reading one input tensor (q/k/v, gate/up) share its Gram and its scaled copy in bk."""

import pytest
import torch
from torch import nn

from dptorch.grad_sample.norms.shared_inputs import AffineUse, group_by_input, shared_affine_clipped_sums, shared_affine_norms_sq
from tests.grad_sample.test_fast_clipping import assert_modes_agree
from tests.helpers import projection_loss


class SharedInputs(nn.Module):
    """q/k/v and gate/up read the same tensors; some with bias."""

    def __init__(self, d, p, wide):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, p), nn.Linear(d, p, bias=False), nn.Linear(d, p)
        self.gate, self.up = nn.Linear(p, wide, bias=False), nn.Linear(p, wide)
        self.down = nn.Linear(wide, 3)

    def forward(self, x):
        h = torch.tanh(self.q(x) + self.k(x) * self.v(x))
        return self.down(torch.tanh(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("t,d,p,wide", [(3, 16, 16, 40), (20, 6, 5, 7), (1, 8, 8, 4)], ids=["ghost", "instantiated", "one-token"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_shared_inputs_equal_hooks(t, d, p, wide, clipping):
    torch.manual_seed(0)
    model = SharedInputs(d, p, wide)
    assert_modes_agree(model, (torch.randn(4, t, d),), projection_loss, modes=("bk", "ghost"), clipping=clipping)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharing_is_by_memory_not_by_value(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 12, dtype=dtype)
    layers = [nn.Linear(12, 12, dtype=dtype) for _ in range(3)]
    backprops = [torch.randn(3, 5, 12, dtype=dtype) for _ in layers]
    shared = [AffineUse(x, b, l.weight, l.bias) for l, b in zip(layers, backprops)]
    copies = [AffineUse(x.clone(), b, l.weight, l.bias) for l, b in zip(layers, backprops)]
    assert group_by_input(shared) == [[0, 1, 2]]
    assert group_by_input(copies) == [[0], [1], [2]]
    assert group_by_input([AffineUse(x.view(3, 60).view(3, 5, 12), backprops[0], None, None), shared[0]]) == [[0, 1]]
    assert group_by_input([AffineUse(x[:, 1:], backprops[0][:, 1:], None, None), shared[0]]) == [[0], [1]]
    factor = torch.rand(3)
    factors = [(factor, factor)] * 3
    for got, want in zip(shared_affine_norms_sq(shared), shared_affine_norms_sq(copies)):
        for p in want:
            torch.testing.assert_close(got[p], want[p], rtol=1e-5, atol=1e-6)
    for got, want, l, b in zip(shared_affine_clipped_sums(shared, factors), shared_affine_clipped_sums(copies, factors), layers, backprops):
        exact = torch.einsum("i,itp,itd->pd", factor.double(), b.double(), x.double())
        torch.testing.assert_close(got[l.weight].double(), exact, rtol=1e-5, atol=1e-5)
        assert got[l.weight].dtype == torch.float32
        torch.testing.assert_close(got[l.weight], want[l.weight], rtol=1e-5, atol=1e-6)


class TiedLM(nn.Module):
    """An embedding looked up twice, its weight reused as the output head."""

    def __init__(self, vocab, d, padding_idx):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids) + self.emb(ids.flip(1))))
        return self.head(h)


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hooks_mode_tied_embedding_rows_equal_functorch(padding_idx, dtype):
    from dptorch.grad_sample import GradSampleHooks

    torch.manual_seed(0)
    model = TiedLM(11, 6, padding_idx).to(dtype)
    ids = torch.randint(0, 11, (3, 5))
    ids[0, :2] = 0
    grads = {}
    for mode in ("hooks", "functorch"):
        with GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum") as hooks:
            model.zero_grad()
            projection_loss(model(ids)).sum().backward()
            grads[mode] = {p: g.clone() for p, g in hooks.grad_samples.items()}
    assert set(grads["hooks"]) == set(grads["functorch"])
    for p, want in grads["functorch"].items():
        got = grads["hooks"][p]
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["hooks"][model.emb.weight].sum(0), model.emb.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [2, 30])
def test_mixed_dtypes_and_bias_only_uses(t):
    torch.manual_seed(0)
    x = torch.randn(2, t, 8, dtype=torch.bfloat16)
    lin = nn.Linear(8, 4)
    b64 = torch.randn(2, t, 4, dtype=torch.float64)
    uses = [AffineUse(x, b64, lin.weight, lin.bias), AffineUse(x, b64.float(), None, lin.bias)]
    norms = shared_affine_norms_sq(uses)
    exact = torch.einsum("itp,itd->ipd", b64, x.double()).flatten(1).pow(2).sum(1)
    torch.testing.assert_close(norms[0][lin.weight].double(), exact, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(norms[1][lin.bias].double(), b64.sum(1).pow(2).sum(1), rtol=1e-5, atol=1e-6)
    factor = torch.rand(2)
    sums = shared_affine_clipped_sums(uses, [(factor, factor), (None, factor)])
    want = torch.einsum("i,itp,itd->pd", factor.double(), b64, x.double())
    torch.testing.assert_close(sums[0][lin.weight].double(), want, rtol=1e-6, atol=1e-6)
    assert lin.weight not in sums[1]


@pytest.mark.parametrize("t", [1, 3, 40])
def test_empty_batch(t):
    lin = nn.Linear(8, 4)
    x = torch.randn(0, t, 8)
    uses = [AffineUse(x, torch.randn(0, t, 4), lin.weight, lin.bias), AffineUse(x, torch.randn(0, t, 4), lin.weight, None)]
    norms = shared_affine_norms_sq(uses)
    assert norms[0][lin.weight].shape == (0,) and norms[0][lin.bias].shape == (0,)
    sums = shared_affine_clipped_sums(uses, [(torch.rand(0), torch.rand(0)), (torch.rand(0), None)])
    assert torch.equal(sums[0][lin.weight], torch.zeros(4, 8)) and torch.equal(sums[0][lin.bias], torch.zeros(4))


def _blocks(t, d, widths, batch=3, dtype=torch.float32):
    """One use per width, each reading its own input (a deep narrow model's blocks), with float64 copies."""
    layers = [nn.Linear(d, p, dtype=dtype) for p in widths]
    inputs = [torch.randn(batch, t, d, dtype=dtype) for _ in widths]
    backprops = [torch.randn(batch, t, p, dtype=dtype) for p in widths]
    return layers, [AffineUse(x, b, l.weight, l.bias) for l, x, b in zip(layers, inputs, backprops)]


def _patch_stack_limit(monkeypatch, limit):
    import dptorch.grad_sample.norms.linear_forms as linear_forms
    import dptorch.grad_sample.norms.shared_inputs as shared_inputs

    monkeypatch.setattr(linear_forms, "STACK_LIMIT", limit)
    monkeypatch.setattr(shared_inputs, "STACK_LIMIT", limit)


@pytest.mark.parametrize("t,d", [(4, 12), (20, 6)], ids=["ghost", "instantiated"])
def test_stacked_groups_equal_each_group_alone_and_the_exact_values(monkeypatch, t, d):
    """Groups of one shape are computed as one stack; each gets its own norms and clipped sums."""
    from dptorch.grad_sample.norms.shared_inputs import shared_affine_norms_and_grads, stacks

    torch.manual_seed(0)
    layers, uses = _blocks(t, d, [20, 20, 20, 7, 20])
    assert stacks(uses) == [[[0], [1], [2], [4]], [[3]]]
    shared = torch.rand(3)
    factors = [(shared, torch.rand(3)), (shared, shared), (torch.rand(3), None), (shared, shared), (shared, shared)]
    norms, grads = shared_affine_norms_and_grads(uses)
    sums = shared_affine_clipped_sums(uses, factors)
    _patch_stack_limit(monkeypatch, 0)
    assert stacks(uses) == [[[i]] for i in range(5)]
    alone_norms, alone_grads = shared_affine_norms_and_grads(uses)
    alone_sums = shared_affine_clipped_sums(uses, factors)
    for use, (wf, bf), n, g, s, an, ag, as_ in zip(uses, factors, norms, grads, sums, alone_norms, alone_grads, alone_sums):
        x, b = use.inputs.double(), use.backprops.double()
        exact = torch.einsum("itp,itd->ipd", b, x)
        true_sq = exact.flatten(1).pow(2).sum(1)
        assert (n[use.weight].double() >= true_sq * (1 - 1e-6)).all()  # a certified norm never falls below
        torch.testing.assert_close(n[use.weight].double(), true_sq, rtol=1e-4, atol=0)
        torch.testing.assert_close(n[use.weight], an[use.weight], rtol=1e-6, atol=0)
        torch.testing.assert_close(n[use.bias].double(), b.sum(1).pow(2).sum(1), rtol=1e-5, atol=0)
        assert g.keys() == ag.keys()
        for p in g:
            torch.testing.assert_close(g[p], ag[p], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s[use.weight].double(), torch.einsum("i,ipd->pd", wf.double(), exact), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s[use.weight], as_[use.weight], rtol=1e-6, atol=1e-6)
        assert (use.bias in s) == (bf is not None) == (use.bias in as_)
        if bf is not None:
            torch.testing.assert_close(s[use.bias].double(), bf.double() @ b.sum(1), rtol=1e-5, atol=1e-5)


def test_large_groups_are_not_stacked(monkeypatch):
    """Above the limit nothing is stacked (so nothing is copied): each group is its own stack."""
    from dptorch.grad_sample.norms.shared_inputs import stacks

    torch.manual_seed(0)
    _, uses = _blocks(4, 12, [20] * 4)
    size = uses[0].inputs.numel() + uses[0].backprops.numel()
    _patch_stack_limit(monkeypatch, 2 * size)
    assert stacks(uses) == [[[0], [1]], [[2], [3]]]
    _patch_stack_limit(monkeypatch, 2 * size - 1)
    assert stacks(uses) == [[[i]] for i in range(4)]


def test_weighted_sums_equal_each_alone(monkeypatch):
    """Per-sample tensors sharing a factor and a shape are summed in one stack, each its own sum."""
    from dptorch.grad_sample.norms.linear_forms import weighted_sum, weighted_sums

    torch.manual_seed(0)
    f, g = torch.rand(3), torch.rand(3)
    pairs = [(f, torch.randn(3, 5, 2)), (f, torch.randn(3, 5, 2)), (g, torch.randn(3, 5, 2)), (f, torch.randn(3)),
             (f, torch.randn(3, 5, 2, dtype=torch.bfloat16)), (f, torch.randn(3, 5, 2))]
    for limit in (1 << 18, 20, 0):
        _patch_stack_limit(monkeypatch, limit)
        for (factor, per_sample), got in zip(pairs, weighted_sums(pairs)):
            want = weighted_sum(factor, per_sample)
            assert got.shape == want.shape == per_sample.shape[1:] and got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            exact = torch.einsum("i,i...->...", factor.double(), per_sample.double())
            torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


class _LargestFloat64:
    """The most elements of any float64 tensor an operation makes inside the block."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                        seen.largest = max(seen.largest, t.numel())
                return out

        self.largest, self._mode = 0, Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


@pytest.mark.parametrize("t", [1, 8], ids=["one-token", "ghost"])
def test_certified_norms_copy_to_float64_a_block_of_samples_at_a_time(monkeypatch, t):
    """A wide output gradient (an LM head's ``(B, T, vocab)``) is never copied to float64 whole: the
    certified norms take ``WIDE_BLOCK`` elements of the widest operand at a time, each sample's
    arithmetic its own (the same norms as in one block, up to the float64 rounding of a batched matmul,
    which may depend on the number of matrices)."""
    import dptorch.grad_sample.norms.shared_inputs as shared_inputs

    torch.manual_seed(0)
    x = torch.randn(6, t, 12)
    head, other = nn.Linear(12, 40), nn.Linear(12, 30, bias=False)
    uses = [AffineUse(x, torch.randn(6, t, 40), head.weight, head.bias), AffineUse(x, torch.randn(6, t, 30), other.weight, None)]
    monkeypatch.setattr(shared_inputs, "INSTANTIATED_MEMORY", 0)  # ghost norms, whatever the shape
    monkeypatch.setattr(shared_inputs, "WIDE_BLOCK", 1 << 30)
    with _LargestFloat64() as whole:
        want = shared_affine_norms_sq(uses)
    assert whole.largest == 6 * t * 40  # the head's output gradient, whole
    monkeypatch.setattr(shared_inputs, "WIDE_BLOCK", 2 * t * 40 + 1)  # two samples of it
    with _LargestFloat64() as blocked:
        got = shared_affine_norms_sq(uses)
    assert blocked.largest == 2 * t * 40
    exact = torch.einsum("itp,itd->ipd", uses[0].backprops.double(), x.double()).flatten(1).pow(2).sum(1)
    assert (got[0][head.weight].double() >= exact).all()  # certified: never below
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for p in w:
            torch.testing.assert_close(g[p], w[p], rtol=1e-12, atol=0)
