"""Packed Linear / Conv1D calls (``packed_affine``): norms and clipped sums from the packed tokens.

Checked against each example alone (batch of one, unpacked) and against the generic one-unit-per-row
regroup, for GPT-2 (Conv1D, tied head) and Llama (Linear, tied and untied embeddings) in bk and ghost,
with units of unequal lengths, pads, and a unit alone in its row. The widths and lengths make some
buckets ghost and others instantiated.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptorch.clipping.factors import clip_factors
from dptorch.grad_sample import packed_affine
from dptorch.grad_sample.capture.backward import CallBackward
from dptorch.grad_sample.units.packed_affine import PackedLayout, bucket_bounds
from dptorch.grad_sample.norms.shared_inputs import AffineUse
from dptorch.grad_sample.units.token_units import TokenUnits
from dptorch.integrations.hf.packing import PackingCollator
from dptorch.integrations.hf.sampling import UNIT_IDS_KEY
from tests.grad_sample.test_token_units import C, alone, examples, packed_clipped_sum, reference_clipped_sum

VOCAB = 50
LENGTHS = [2, 5, 9, 32, 12, 1, 20, 27, 3, 17, 6]  # 32 fills a row alone; 1 has no target


def model_for(arch: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                             tie_word_embeddings=arch == "llama-tied"))
    model.config._attn_implementation = "sdpa"
    return model.train()


@pytest.fixture
def spy(monkeypatch):
    """Counts the packed calls whose norms ``packed_affine`` formed."""
    seen = []
    inner = packed_affine.packed_affine_norms_and_grads

    def counted(uses, layout):
        seen.append(len(uses))
        return inner(uses, layout)

    monkeypatch.setattr("dptorch.grad_sample.modes.book_keeping.packed_affine_norms_and_grads", counted)
    return seen


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama-tied"])
def test_packed_affine_matches_each_example_alone(arch, mode, spy):
    model = model_for(arch)
    items = examples(LENGTHS, vocab=VOCAB)
    batch = PackingCollator(pad_token_id=0, max_length=32)(items)
    assert bool((batch[UNIT_IDS_KEY] < 0).any())  # pads
    norms, sums = packed_clipped_sum(model, batch, mode)
    assert spy and sum(spy) >= 8  # the attention and MLP projections took the packed path
    ref_norms, ref_sums = reference_clipped_sum(alone(model, items))
    torch.testing.assert_close(norms.double(), ref_norms, rtol=1e-4, atol=1e-6)
    for p, ref in ref_sums.items():
        torch.testing.assert_close(sums[p].double(), ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_affine_equals_the_regroup_and_drops_a_unit_to_zero(arch, monkeypatch):
    model = model_for(arch)
    items = examples(LENGTHS, seed=4, vocab=VOCAB)
    batch = PackingCollator(pad_token_id=0, max_length=32)(items)
    dropped = torch.zeros(len(items), dtype=torch.bool)
    dropped[3] = True
    fast = packed_clipped_sum(model, batch, "bk", dropped)
    monkeypatch.setattr(CallBackward, "_packed_affine", lambda *args: False)
    slow = packed_clipped_sum(model, batch, "bk", dropped)
    torch.testing.assert_close(fast[0], slow[0], rtol=1e-4, atol=1e-7)
    for p in slow[1]:
        torch.testing.assert_close(fast[1][p], slow[1][p], rtol=1e-4, atol=1e-6)
    # the dropped unit is exactly absent: the clipped sum of the others, each alone
    ref_norms, _ = reference_clipped_sum(alone(model, items))
    kept_items = [item for i, item in enumerate(items) if not dropped[i]]
    grads = alone(model, kept_items)
    factors = clip_factors(ref_norms[~dropped].float(), C).double()
    for p in grads[0]:
        ref = sum(f * row[p].double() for f, row in zip(factors, grads))
        torch.testing.assert_close(fast[1][p].double(), ref, rtol=1e-4, atol=1e-6)


def test_bucket_bounds_are_the_cut_that_pads_least():
    lengths = [1, 2, 2, 3, 10, 11, 30, 31, 31, 32]
    bounds = bucket_bounds(lengths, 4)
    assert bounds == [(0, 3), (3, 11), (11, 32)] or len(bounds) == 4
    assert bounds[0][0] == 0 and bounds[-1][1] == 32
    assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
    area = lambda bs: sum(max(n for n in lengths if lo < n <= hi) * sum(lo < n <= hi for n in lengths) for lo, hi in bs)
    assert area(bounds) <= area([(0, 3), (3, 11), (11, 30), (30, 32)])
    assert bucket_bounds([7, 7], 4) == [(0, 7)] and bucket_bounds([], 4) == []
    assert len(bucket_bounds(list(range(1, 5000, 7)), 4)) == 4  # long rows: lengths on a grid


def test_the_layout_holds_every_real_token_once_and_no_pad():
    ids = torch.tensor([[0, 0, 0, 1, -1, 2], [3, 3, 3, 3, 3, -1], [-1, 4, 4, 5, 5, 5]])
    layout = PackedLayout(TokenUnits(ids))
    positions = layout.all_tokens().sort().values
    assert positions.tolist() == torch.nonzero(ids.flatten() >= 0).flatten().tolist()
    x = torch.arange(18.0).view(3, 6, 1) + 1
    for bucket, gathered in zip(layout.buckets, layout.gather(x, layout.buckets)):
        rows = gathered[..., 0]
        for r, u in enumerate(bucket.units.tolist()):
            mine = x.flatten()[ids.flatten() == u]
            assert rows[r, : mine.numel()].tolist() == mine.tolist() and not rows[r, mine.numel():].any()


def test_a_batch_of_pads_only_gives_zero_units_and_zero_sums():
    from dptorch.grad_sample.units.packed_affine import packed_affine_clipped_sums, packed_affine_norms_and_grads
    from dptorch.grad_sample.norms.shared_inputs import AffineUse

    layer = nn.Linear(4, 3)
    layout = PackedLayout(TokenUnits(torch.full((2, 5), -1)))
    use = AffineUse(torch.randn(2, 5, 4), torch.randn(2, 5, 3), layer.weight, layer.bias)
    (squared,), (kept,) = packed_affine_norms_and_grads([use], layout)
    assert squared[layer.weight].shape == squared[layer.bias].shape == (0,) and kept.grads[layer.bias].shape == (0, 3)
    (summed,) = packed_affine_clipped_sums([use], [(torch.zeros(0), None)], [kept.unkept_tokens], layout)
    assert torch.equal(summed[layer.weight], torch.zeros(3, 4))


# ----------------------------------------------------------------------------- against each unit alone, at the function

RUNS = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1, 3, 3],  # units as runs of tokens (with pads between), one of one token
                     [4, 4, 4, 4, 4, 4, 5, 6, 6, 6],
                     [7, 7, 7, 7, 7, 7, 7, 7, 7, -1]])
MIXED = torch.tensor([[0] * 5 + [1] * 3 + [2] * 62,  # long units (instantiated) beside short ones (ghost)
                      [3] * 2 + [4] * 60 + [5] * 6 + [-1] * 2,
                      [6] * 1 + [7] * 4 + [8] * 65])
INTERLEAVED = torch.tensor([[0, 1, 0, 1, 0, 2, -1, 2, 3, 3],  # tokens of one unit apart: no runs, buckets only
                            [4, 5, 4, 6, 4, 6, 4, 6, 4, 4],
                            [7, 7, -1, 7, 7, 7, 7, 7, 7, 7]])


def unit_alone(x: torch.Tensor, ids: torch.Tensor, u: int) -> torch.Tensor:
    """Unit ``u``'s token rows of ``x`` (B, T, *middle, w), as (tokens * middle, w) in float64."""
    return x.reshape(ids.numel(), -1, x.shape[-1])[ids.flatten() == u].reshape(-1, x.shape[-1]).double()


def packed_uses(d: int, p: int, middle: int, ids: torch.Tensor):
    """Three uses: a Linear and an (in, out) weight reading one input, and a bias alone reading another; pads hold
    NaN, unit 4 (dropped below) holds inf."""
    g = torch.Generator().manual_seed(d + p + middle)
    shape = (*ids.shape, *([middle] if middle > 1 else []))
    pads = (ids < 0).view(*ids.shape, *([1] * (len(shape) - 1)))

    def values(width: int) -> torch.Tensor:
        x = torch.randn(*shape, width, generator=g)
        x = x.masked_fill(pads, float("nan"))
        return x.masked_fill((ids == 4).view(pads.shape) & (torch.rand(x.shape, generator=g) < 0.1), float("inf"))

    linear, other, lone = nn.Linear(d, p), nn.Parameter(torch.randn(d, p + 1)), nn.Parameter(torch.randn(p))
    a = values(d)
    return [AffineUse(a, values(p), linear.weight, linear.bias), AffineUse(a, values(p + 1), other, None, in_by_out=True),
            AffineUse(values(d), values(p), None, lone)]


def reference_grads(use: AffineUse, ids: torch.Tensor, units: int) -> dict:
    """Each unit's gradients from its own tokens only: ``sum_t b_t a_t^T`` (or its transpose) and ``sum_t b_t``."""
    out = {}
    for u in range(units):
        a, b = unit_alone(use.inputs, ids, u), unit_alone(use.backprops, ids, u)
        if use.weight is not None:
            out.setdefault(use.weight, []).append(a.T @ b if use.in_by_out else b.T @ a)
        if use.bias is not None:
            out.setdefault(use.bias, []).append(b.sum(0))
    return {param: torch.stack(grads) for param, grads in out.items()}


@pytest.mark.parametrize("ids,d,p,middle", [
    (RUNS, 8, 6, 1), (INTERLEAVED, 8, 6, 1), (RUNS, 256, 256, 1), (INTERLEAVED, 256, 256, 1), (RUNS, 6, 5, 3),
    (INTERLEAVED, 6, 5, 3), (MIXED, 64, 400, 1)],
    ids=["small", "small-interleaved", "ghost", "ghost-interleaved", "middle-dims", "middle-dims-interleaved", "mixed"])
def test_packed_norms_and_clipped_sums_equal_each_unit_alone(ids, d, p, middle):
    from dptorch.grad_sample.units.packed_affine import packed_affine_clipped_sums, packed_affine_norms_and_grads

    layout = PackedLayout(TokenUnits(ids))
    assert (layout.spans is None) == (ids is INTERLEAVED)
    uses = packed_uses(d, p, middle, ids)
    squared, kept = packed_affine_norms_and_grads(uses, layout)
    ghost = layout.token_unit[kept[0].unkept_tokens].unique() if kept[0].unkept_tokens is not None else []
    assert len(ghost) == {RUNS: 0 if d < 256 else layout.num_units, MIXED: 6}.get(ids, len(ghost))
    if len(ghost) and uses[0].weight in kept[0].grads:  # short units' weights ghost, long ones' instantiated
        assert not kept[0].grads[uses[0].weight][ghost].any()  # their rows of the kept gradient add nothing
    factor = torch.rand(layout.num_units, generator=torch.Generator().manual_seed(1))
    dropped = torch.arange(layout.num_units) == 4
    for use, value, held in zip(uses, squared, kept):
        reference = reference_grads(use, ids, layout.num_units)
        for param, grads in reference.items():
            finite = ~dropped
            torch.testing.assert_close(value[param][finite], grads[finite].flatten(1).square().sum(1), rtol=1e-4, atol=1e-8)
            expected = (factor[finite].double()[:, None] * grads[finite].flatten(1)).sum(0).view(grads.shape[1:])
            summed = torch.zeros(grads.shape[1:], dtype=torch.float64)
            if param in held.grads:  # instantiated: the weighted sum over units, a dropped unit's row exactly out
                rows = torch.where(dropped.view(-1, *[1] * (grads.dim() - 1)), 0.0, held.grads[param].double())
                summed += (factor.double()[:, None] * rows.flatten(1)).sum(0).view(grads.shape[1:])
            if param is use.weight and (param not in held.grads or held.unkept_tokens is not None):
                factors = (factor, None) if param is use.weight else (None, factor)
                only = AffineUse(use.inputs, use.backprops, use.weight, None, use.in_by_out)
                (token_sum,) = packed_affine_clipped_sums([only], [factors], [held.unkept_tokens], layout, dropped)
                summed += token_sum[param].double()
            assert torch.isfinite(summed).all()
            # float32 sums of up to 65 products of O(1) numbers: rounding up to about 1e-7 * 65 * 8 absolute
            torch.testing.assert_close(summed, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ids", [RUNS, INTERLEAVED], ids=["runs", "interleaved"])
def test_per_unit_grads_of_a_tied_call_equal_each_unit_alone(ids):
    from dptorch.grad_sample.units.packed_affine import packed_per_unit_grads

    layout = PackedLayout(TokenUnits(ids))
    use = packed_uses(7, 5, 1, ids)[0]
    module = nn.Linear(7, 5)
    module.weight, module.bias = use.weight, use.bias
    grads = packed_per_unit_grads(module, use.inputs, use.backprops, layout, in_by_out=False, scale=3.0)
    finite = torch.arange(layout.num_units) != 4
    for param, reference in reference_grads(use, ids, layout.num_units).items():
        torch.testing.assert_close(grads[param][finite].double(), 3.0 * reference[finite], rtol=1e-5, atol=1e-6)


def test_token_runs_are_found_only_where_every_unit_is_one():
    assert TokenUnits(RUNS).spans() == [(0, 3), (3, 5), (5, 6), (8, 10), (10, 16), (16, 17), (17, 20), (20, 29)]
    assert TokenUnits(INTERLEAVED).spans() is None
    assert TokenUnits(torch.full((2, 3), -1)).spans() == []


def test_a_layout_does_not_keep_its_units_alive():
    import gc
    import weakref

    from dptorch.grad_sample.units.packed_affine import layout_of

    units = TokenUnits(RUNS)
    layout_of(units)
    gone = weakref.ref(units)
    del units
    gc.collect()
    assert gone() is None


def test_a_tied_embedding_adds_its_rows_to_the_heads_per_unit_gradient(monkeypatch):
    """GPT-2's tied wte: the head's per-unit gradient is instantiated (no factored norm at this width) and
    the lookup's rows are added into it, with no dense (U, V, d) gradient of the lookup; exact against alone."""
    from dptorch.grad_sample.layers import embedding

    dense = []
    inner = embedding.scatter_rows_per_sample
    monkeypatch.setattr(embedding, "scatter_rows_per_sample", lambda *args, **kw: dense.append(1) or inner(*args, **kw))
    model = model_for("gpt2")
    items = examples(LENGTHS, seed=5, vocab=VOCAB)
    norms, sums = packed_clipped_sum(model, PackingCollator(pad_token_id=0, max_length=32)(items), "bk")
    assert not dense
    ref_norms, ref_sums = reference_clipped_sum(alone(model, items))
    torch.testing.assert_close(norms.double(), ref_norms, rtol=1e-4, atol=1e-6)
    weight = model.transformer.wte.weight
    torch.testing.assert_close(sums[weight].double(), ref_sums[weight], rtol=1e-4, atol=1e-6)


def test_the_buckets_a_token_list_was_made_of_are_found_again():
    """The clipped sum lays a use's tokens out in the buckets they came from (no unit lookup); a list the layout
    did not make gets the buckets of the units it holds, which cover the same tokens."""
    layout = PackedLayout(TokenUnits(MIXED))
    some = layout.buckets_of((0, 1, 3, 5, 6, 7))
    listed = layout.tokens(some)
    assert layout.buckets_listed(listed) == some
    again = layout.buckets_listed(listed.clone())
    assert sorted(torch.cat([b.units for b in again]).tolist()) == [0, 1, 3, 5, 6, 7]
    assert torch.equal(layout.tokens(again).sort().values, listed.sort().values)
