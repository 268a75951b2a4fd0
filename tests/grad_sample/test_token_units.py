"""Token privacy units: examples packed into shared rows, each clipped on its own.

Every packed result is checked against the batch-of-one reference: each example alone, in its
own unpacked row, with its own mean next-token loss. Then the refusals: attention that lets one
packed example see another, a loss other than ``packed_loss``, layers and operations that mix
token positions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptorch import packed_loss
from dptorch.clipping.factors import clip_factors, flat_norms
from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError
from dptorch.grad_sample.units.token_units import (
    TokenUnits,
    units_from_cu_seq_lens,
    units_from_position_ids,
    units_from_seq_lengths,
)
from dptorch.integrations.hf.packing import PackingCollator, best_fit_decreasing
from dptorch.integrations.hf.sampling import UNIT_IDS_KEY

VOCAB = 40
C = 0.5


def tiny(arch: str, attn: str = "sdpa") -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
    else:
        common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
        model = LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    model.config._attn_implementation = attn
    return model.train()


def examples(lengths, seed: int = 0, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (n,), generator=g)} for n in lengths]


def packed_clipped_sum(model, batch, mode: str, dropped=None):
    """Per-unit norms and the clipped sum of one packed forward and backward (``dropped``: units left out)."""
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    try:
        hooks.set_privacy_units(batch[UNIT_IDS_KEY])
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        packed_loss(out.logits, batch["labels"], hooks).backward()
        norms = hooks.per_sample_norms()
        total = flat_norms(norms)
        factors = clip_factors(total, C)
        sums = hooks.clipped_sums({p: factors for p in norms}, dropped)
        return total, sums
    finally:
        hooks.cleanup()
        model.zero_grad(set_to_none=True)


def alone(model, items):
    """Each example's gradient in a batch of one, unpacked: its mean next-token loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for item in items:
        ids = item["input_ids"][None]
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits[0, :-1], ids[0, 1:]).backward() if ids.shape[1] > 1 else None
        grads.append({p: torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params})
    model.zero_grad(set_to_none=True)
    return grads


def reference_clipped_sum(grads):
    norms = torch.stack([torch.sqrt(sum((g.double() ** 2).sum() for g in row.values())) for row in grads])
    factors = clip_factors(norms.float(), C).double()
    return norms, {p: sum(f * row[p].double() for f, row in zip(factors, grads)) for p in grads[0]}


def assert_matches(model, batch, items, mode: str):
    norms, sums = packed_clipped_sum(model, batch, mode)
    ref_norms, ref_sums = reference_clipped_sum(alone(model, items))
    torch.testing.assert_close(norms.double(), ref_norms, rtol=1e-4, atol=1e-6)
    for p, ref in ref_sums.items():
        torch.testing.assert_close(sums[p].double(), ref, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------- unit ids


def test_unit_ids_from_what_packing_collators_emit():
    lengths = [[3, 2], [4]]
    ids = units_from_seq_lengths(lengths, 6)
    assert ids.tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    assert units_from_position_ids(positions, mask).tolist() == ids.tolist()
    assert units_from_cu_seq_lens(torch.tensor([0, 3, 5]), 6).tolist() == [[0, 0, 0, 1, 1, -1]]
    assert units_from_position_ids(torch.tensor([0, 0, 1, 0])).tolist() == [[0, 1, 1, 2]]  # an example of one token


def test_a_unit_must_stay_in_one_row():
    with pytest.raises(ValueError, match="spans several batch rows"):
        TokenUnits(torch.tensor([[0, 0, 1], [1, 2, 2]]))


def test_best_fit_decreasing_fills_the_fullest_bin_that_fits():
    # 5 opens a bin (room 3), 4 another (room 4); the first 3 goes to the fuller (room 0), the second
    # to the other (room 1); 2 opens a third; 1 goes to the fullest that fits (room 1)
    assert best_fit_decreasing([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    assert best_fit_decreasing([9, 2], 4) == [[0], [1]]  # a too long example fills a row of its own (truncated)


def test_packing_collator_keeps_each_example_whole_and_its_own():
    items = examples([5, 4, 3, 1])
    batch = PackingCollator(pad_token_id=0, max_length=6)(items)
    units = batch[UNIT_IDS_KEY]
    for i, item in enumerate(items):
        rows = torch.nonzero(units == i)
        assert rows[:, 0].unique().numel() == 1  # one row
        r = int(rows[0, 0])
        assert torch.equal(batch["input_ids"][r][units[r] == i], item["input_ids"])
        assert torch.equal(batch["position_ids"][r][units[r] == i], torch.arange(len(item["input_ids"])))
    assert "attention_mask" not in batch
    assert torch.equal(batch["labels"][units < 0], torch.full_like(batch["labels"][units < 0], -100))


# ------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_packed_examples_match_each_example_alone(arch, mode):
    model = tiny(arch)
    items = examples([5, 3, 4, 1, 6, 2])  # one of a single token: no target, a zero gradient
    assert_matches(model, PackingCollator(pad_token_id=0, max_length=8)(items), items, mode)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_padding_free_one_row_matches_each_example_alone(mode):
    model = tiny("llama")
    items = examples([4, 7, 2, 5], seed=1)
    batch = PackingCollator(pad_token_id=0, max_length=None)(items)
    assert batch["input_ids"].shape == (1, 18)
    assert_matches(model, batch, items, mode)


def test_a_tied_head_and_a_trainable_embedding_match_alone_in_bk():
    model = tiny("gpt2")  # lm_head ties wte: one parameter, two calls
    assert model.lm_head.weight is model.transformer.wte.weight
    items = examples([3, 6, 2, 5], seed=2)
    assert_matches(model, PackingCollator(pad_token_id=0, max_length=7)(items), items, "bk")


def test_replacing_one_packed_example_moves_the_clipped_sum_by_at_most_2c():
    model = tiny("llama")
    items = examples([5, 3, 4, 6, 2], seed=3)
    other = list(items)
    other[1] = examples([7], seed=9)[0]  # another length: the rows are packed differently
    collate = PackingCollator(pad_token_id=0, max_length=8)
    _, sums = packed_clipped_sum(model, collate(items), "bk")
    _, sums_other = packed_clipped_sum(model, collate(other), "bk")
    moved = torch.sqrt(sum(((sums[p] - sums_other[p]).double() ** 2).sum() for p in sums))
    assert moved > 0
    assert moved <= 2 * C * (1 + 1e-5)


# ------------------------------------------------------------------------------- refusals


def _packed_forward(model, batch, mode="bk", **kwargs):
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    hooks.set_privacy_units(batch[UNIT_IDS_KEY])
    kwargs.setdefault("use_cache", False)
    return hooks, model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **kwargs)


@pytest.fixture
def packed():
    return PackingCollator(pad_token_id=0, max_length=8)(examples([5, 3, 4, 2]))


def test_a_whole_row_causal_mask_is_refused(packed):
    model = tiny("llama")  # use_cache left on: transformers then skips its packed mask and attends the whole row
    with pytest.raises(PerSampleGradientError, match="attend to another"):
        _packed_forward(model, packed, use_cache=True)


class TinyAttention(nn.Module):
    """Embedding, one attention of the given mask, a head: what the mask says is all that mixes tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, mask=None, causal=False):
        q, k, v = self.qkv(self.embed(input_ids)).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.head(h.transpose(1, 2).flatten(2))


def _block_causal(packed):
    return TokenUnits(packed[UNIT_IDS_KEY]).same_unit() & torch.ones(8, 8, dtype=torch.bool).tril()


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_that_keeps_examples_apart_matches_each_alone(packed, kind):
    model = TinyAttention().train()
    block = _block_causal(packed)[:, None]
    mask = block if kind == "bool" else torch.zeros(block.shape).masked_fill(~block, torch.finfo(torch.float32).min)
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    hooks.set_privacy_units(packed[UNIT_IDS_KEY])
    packed_loss(model(packed["input_ids"], mask), packed["labels"], hooks).backward()
    norms = flat_norms(hooks.per_sample_norms())
    hooks.cleanup()
    units = TokenUnits(packed[UNIT_IDS_KEY])
    for u in range(units.num_units):
        b, ts = torch.nonzero(units.ids == u, as_tuple=True)
        ids = packed["input_ids"][b, ts][None]
        model.zero_grad()
        F.cross_entropy(model(ids, causal=True)[0, :-1], ids[0, 1:]).backward()
        alone_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
        torch.testing.assert_close(norms[u].float(), alone_norm, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("leak", ["one entry", "causal over the row", "a mild float penalty"])
def test_a_mask_that_lets_one_example_see_another_is_refused(packed, leak):
    model = TinyAttention().train()
    block = _block_causal(packed)
    if leak == "one entry":
        mask, causal = block.clone(), False
        mask[0, 5, 0] = True  # a token of row 0's second example may see its first
    elif leak == "causal over the row":
        mask, causal = None, True
    else:
        mask, causal = torch.zeros(block.shape).masked_fill(~block, -1e4), False  # exp(-1e4) is 0, but not by the mask
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    hooks.set_privacy_units(packed[UNIT_IDS_KEY])
    with pytest.raises(PerSampleGradientError, match=r"lets one packed example attend to another \(row 0: token"):
        model(packed["input_ids"], None if mask is None else mask[:, None], causal)


def test_eager_attention_is_refused_with_the_fix(packed):
    model = tiny("llama", attn="eager")
    with pytest.raises(PerSampleGradientError, match="attn_implementation='sdpa'"):
        _packed_forward(model, packed, use_cache=False)


@pytest.mark.parametrize("loss", ["model", "sum", "changed logits"])
def test_only_packed_loss_is_accepted(packed, loss):
    model = tiny("gpt2")
    hooks, out = _packed_forward(model, packed, labels=packed["labels"] if loss == "model" else None)
    if loss == "changed logits":
        with pytest.raises(PerSampleGradientError, match="as returned"):
            packed_loss(out.logits * 1.0, packed["labels"], hooks)
        return
    root = out.loss if loss == "model" else out.logits.sum()
    with pytest.raises(PerSampleGradientError, match="packed_loss"):
        root.backward()
    assert all(p.grad is None for p in model.parameters())


def test_a_multiple_of_packed_loss_is_accepted(packed):
    model = tiny("gpt2")
    hooks, out = _packed_forward(model, packed)
    (packed_loss(out.logits, packed["labels"], hooks) / 4).backward()  # gradient accumulation's scaling
    assert hooks.batch_size == 4  # one row per unit


class TimeMixer(nn.Module):
    """Token embeddings, then ``how`` mixes positions, then a head."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(VOCAB, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, position_ids=None):
        h = self.embed(input_ids)
        if self.how == "conv":
            h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        elif self.how == "roll":
            h = torch.roll(h, 1, dims=1)
        elif self.how == "mean":
            h = h + h.mean(dim=1, keepdim=True)
        elif self.how == "gather":  # a shared index of one token: each row's first token, added to all its tokens
            h = h + torch.gather(h, 2, torch.arange(h.shape[-1]).flip(0).expand(h.shape[0], 1, -1))
        return self.head(h)


@pytest.mark.parametrize("how, match", [("conv", "mixes token positions through its parameters"),
                                        ("roll", "token positions do not each hold"),
                                        ("mean", "token positions do not each hold"),
                                        ("gather", "gather with a result of 1 along a batch dimension of 8")])
def test_operations_and_layers_that_mix_positions_are_refused(packed, how, match):
    model = TimeMixer(how).train()
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    hooks.set_privacy_units(packed[UNIT_IDS_KEY])
    with pytest.raises(PerSampleGradientError, match=match):
        model(packed["input_ids"])


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_token_wise_model_without_attention_matches_alone(packed, mode):
    """In functorch mode every layer is replayed by the torch.func fallback, one token at a time."""
    model = TimeMixer("none").train()
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    hooks.set_privacy_units(packed[UNIT_IDS_KEY])
    logits = model(packed["input_ids"])
    packed_loss(logits, packed["labels"], hooks, per_unit="sum").backward()
    units = TokenUnits(packed[UNIT_IDS_KEY])
    grads = model.head.weight.grad_sample
    hooks.cleanup()
    assert grads.shape[0] == units.num_units
    for u in range(units.num_units):
        b, ts = torch.nonzero(units.ids == u, as_tuple=True)
        h = model.embed.weight[packed["input_ids"][b, ts]].detach()
        target = packed["labels"][b, ts][1:]
        model.head.weight.grad = None
        F.cross_entropy(F.linear(h[:-1], model.head.weight, model.head.bias), target, reduction="sum").backward()
        torch.testing.assert_close(grads[u], model.head.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["conv", "roll", "mean", "gather"])
def test_the_functorch_fallback_is_refused_where_tokens_mix(packed, how):
    model = TimeMixer(how).train()
    hooks = GradSampleHooks(model, grad_sample_mode="functorch", loss_reduction="sum")
    hooks.set_privacy_units(packed[UNIT_IDS_KEY])
    with pytest.raises(PerSampleGradientError, match="do not keep each packed token apart"):
        model(packed["input_ids"])


def test_token_units_hold_for_one_forward(packed):
    model = tiny("gpt2")
    hooks, out = _packed_forward(model, packed, use_cache=False)
    packed_loss(out.logits, packed["labels"], hooks).backward()
    assert hooks.batch_size == 4
    hooks.clear()
    out = model(input_ids=packed["input_ids"], use_cache=False)  # not set again: every row is a unit
    out.logits.sum().backward()
    assert hooks.batch_size == packed["input_ids"].shape[0]
    hooks.cleanup()


def test_units_of_another_shape_are_refused(packed):
    model = tiny("gpt2")
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    hooks.set_privacy_units(packed[UNIT_IDS_KEY][:, :5])
    with pytest.raises(PerSampleGradientError, match="do not fit this batch"):
        model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)


def test_two_packed_forwards_in_one_backward_are_refused(packed):
    model = tiny("gpt2")
    hooks, first = _packed_forward(model, packed)
    loss = packed_loss(first.logits, packed["labels"], hooks)
    hooks.set_privacy_units(packed[UNIT_IDS_KEY])
    second = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
    with pytest.raises(PerSampleGradientError, match="different privacy units"):
        (loss + packed_loss(second.logits, packed["labels"], hooks)).backward()


class RowFeature(nn.Module):
    """Token embeddings plus a per-row feature vector: data of the whole row, shared by its examples."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, feature):
        return self.head(self.embed(input_ids) + feature[:, None])


@pytest.mark.parametrize("width", [8, 6])
def test_a_root_argument_of_the_whole_row_is_refused(packed, width):
    """A per-row feature would reach every example of the row; of width T (8) it has a (B, T) shape by chance."""
    model = RowFeature().train()
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    hooks.set_privacy_units(packed[UNIT_IDS_KEY])
    feature = torch.randn(packed["input_ids"].shape[0], width)
    with pytest.raises(PerSampleGradientError, match="not known to hold one entry per token"):
        model(packed["input_ids"], torch.nn.functional.pad(feature, (0, 8 - width)))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_private_step_of_the_engine_adds_each_drawn_examples_clipped_gradient(reduction):
    """make_private with a packing collator: the update is minus the sum of each drawn example's clipped
    gradient alone (divided by the expected batch size under loss_reduction="mean"; no noise, SGD, lr 1)."""
    from dptorch import PrivacyEngine

    model = tiny("llama")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = examples([3, 5, 7, 2, 4, 6, 8, 3], seed=4)
    loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=PackingCollator(pad_token_id=0, max_length=8))
    with pytest.warns(UserWarning, match="noise_multiplier=0"):
        hooks, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
            noise_multiplier=0.0, max_grad_norm=C, wrap_model=False, loss_reduction=reduction)
    batch = next(b for b in loader if b["input_ids"].numel())
    hooks.set_privacy_units(batch[UNIT_IDS_KEY])
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    packed_loss(out.logits, batch["labels"], hooks).backward()
    optimizer.step()
    units = batch[UNIT_IDS_KEY]
    drawn = [{"input_ids": batch["input_ids"][units == u]} for u in range(int(units.max()) + 1)]
    hooks.cleanup()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    _, sums = reference_clipped_sum(alone(model, drawn))
    for n, p in model.named_parameters():
        expected = start[n].double() - sums[p] / (optimizer.expected_batch_size if reduction == "mean" else 1)
        torch.testing.assert_close(after[n].double(), expected, rtol=1e-4, atol=1e-6)
