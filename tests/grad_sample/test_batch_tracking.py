"""A layer input is per-sample because it derives from the batch, never because of its size.

Against the batch-of-one oracle, at T == n (where sizes cannot tell) and T != n: the T5 family's
relative attention bias (a layer called on bucket ids (T, T)), nanoGPT's ``wpe(arange(T))``, a
time-major ``nn.TransformerEncoderLayer`` after ``ModuleValidator.fix`` (its DPMultiheadAttention
transposes to batch-first inside), in modes hooks, bk, ghost and functorch; a batch-derived
tensor that lost its batch dimension is refused; the tracker's rules on their own.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch import ModuleValidator
from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError
from dptorch.grad_sample.tracking import INNER, WEAK, BatchTracker, Lost
from dptorch.layers import DPMultiheadAttention
from tests.grad_sample.oracle import assert_exact
from tests.helpers import projection_loss, snapshot

transformers = pytest.importorskip("transformers")

MODES = ["hooks", "bk", "ghost", "functorch"]
# (n, T) with T == n among the draws; hypothesis varies them, the examples pin the coincidence
SIZES = st.integers(1, 4).flatmap(lambda n: st.tuples(st.just(n), st.sampled_from([n, n, 1, n + 1])))
FEW = settings(max_examples=3, deadline=None, derandomize=True)


# ------------------------------------------------------------------------------------ models


def t5_config(cls, **extra):
    return cls(vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=2,
               relative_attention_num_buckets=8, dropout_rate=0.0, **extra)


def tiny_t5():
    return transformers.T5EncoderModel(t5_config(transformers.T5Config)).train()


T5_FAMILY = {
    "mt5": lambda: transformers.MT5EncoderModel(t5_config(transformers.MT5Config)).train(),
    "longt5": lambda: transformers.LongT5EncoderModel(
        t5_config(transformers.LongT5Config, local_radius=2, encoder_attention_type="local")).train(),
}


def hidden_loss(output):
    return projection_loss(output.last_hidden_state)


class NanoGPT(nn.Module):
    """nanoGPT's block pattern: ``wpe(arange(t))`` of shape (t, d) added to (b, t, d)."""

    def __init__(self, vocab=17, d=8, block=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        q, k, v = self.attn(self.ln(x)).split(x.shape[-1], dim=2)
        y = nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)[:, 0]
        return self.head(x + self.proj(y))


def time_major_layer():
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=False)
    fixed = ModuleValidator.fix(layer)
    assert isinstance(fixed.self_attn, DPMultiheadAttention)
    return fixed


# ------------------------------------------------------------------------------------ exact


@pytest.mark.parametrize("mode", MODES)
@FEW
@given(sizes=SIZES)
@example(sizes=(3, 3))
def test_t5_relative_attention_bias_is_exact(mode, sizes):
    n, t = sizes
    torch.manual_seed(0)
    model = tiny_t5()
    ids = torch.randint(0, 40, (n, t), generator=torch.Generator().manual_seed(n * 7 + t))
    mask = torch.ones_like(ids)
    mask[0, t - 1:] = 0 if t > 1 else 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    assert_exact(model, inputs, {"input_ids": 0, "attention_mask": 0}, hidden_loss, mode, n)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("family", list(T5_FAMILY))
@pytest.mark.parametrize("n,t", [(3, 3), (2, 4)])
def test_t5_family_is_exact(family, mode, n, t):
    torch.manual_seed(0)
    model = T5_FAMILY[family]()
    ids = torch.randint(0, 40, (n, t))
    assert_exact(model, {"input_ids": ids}, {"input_ids": 0}, hidden_loss, mode, n)


def test_t5_encoder_decoder_is_exact():
    """The decoder's causal relative bias meets the batch in ``bias + causal_mask`` first."""
    torch.manual_seed(0)
    config = t5_config(transformers.T5Config, num_decoder_layers=2, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).train()
    inputs = {"input_ids": torch.randint(1, 40, (3, 3)), "decoder_input_ids": torch.randint(1, 40, (3, 3))}
    assert_exact(model, inputs, {"input_ids": 0, "decoder_input_ids": 0}, lambda o: projection_loss(o.logits), "hooks", 3)


def test_t5_step_leaves_no_trace():
    torch.manual_seed(0)
    model = tiny_t5()
    before = snapshot(model)
    with GradSampleHooks(model, loss_reduction="sum") as hooks:  # the loss below is a sum over the batch
        hidden_loss(model(input_ids=torch.randint(0, 40, (3, 3)))).sum().backward()
        assert hooks.grad_samples
    assert snapshot(model) == before


@pytest.mark.parametrize("mode", MODES)
@FEW
@given(sizes=SIZES)
@example(sizes=(3, 3))
def test_nanogpt_positions_without_batch_dim_are_exact(mode, sizes):
    n, t = sizes
    torch.manual_seed(0)
    model = NanoGPT()
    ids = torch.randint(0, 17, (n, t), generator=torch.Generator().manual_seed(n * 7 + t))
    assert_exact(model, (ids,), (0,), projection_loss, mode, n)


def test_expanded_weights_refuse_positions_without_batch_dim():
    model = NanoGPT()
    with GradSampleHooks(model, grad_sample_mode="ew"):
        with pytest.raises(PerSampleGradientError, match=r"wpe \(Embedding\).*not the batch's.*grad_sample_mode='hooks'"):
            model(torch.randint(0, 17, (3, 3)))


@pytest.mark.parametrize("mode", MODES)
@FEW
@given(sizes=SIZES)
@example(sizes=(3, 3))
def test_time_major_encoder_layer_is_exact(mode, sizes):
    n, t = sizes
    torch.manual_seed(0)
    layer = time_major_layer()
    g = torch.Generator().manual_seed(n * 7 + t)
    src = torch.randn(t, n, 8, generator=g)
    causal = nn.Transformer.generate_square_subsequent_mask(t)  # (T, T): shared, though T == n
    padding = torch.zeros(n, t, dtype=torch.bool)  # (N, S): batch first, though the layer is time-major
    padding[0, t - 1:] = t > 1
    inputs = {"src": src, "src_mask": causal, "src_key_padding_mask": padding}
    dims = {"src": 1, "src_mask": None, "src_key_padding_mask": 0}
    loss = lambda out: projection_loss(out, 1)  # noqa: E731
    if t == n > 1:  # nothing tells the (T, T) mask from the samples' data: taken as batched, it meets the batch
        with GradSampleHooks(layer, grad_sample_mode=mode, batch_first=False):  # along another dim: refused
            with pytest.raises(PerSampleGradientError, match="as many rows as the batch.*DP data loader"):
                layer(**inputs)
    # handed out by a DP loader, the batch is followed from its draw: the mask is known to be shared
    draw = ((src.transpose(0, 1).contiguous(), padding),
            lambda s, p: {"src": s.transpose(0, 1), "src_mask": causal, "src_key_padding_mask": p})
    assert_exact(layer, inputs, dims, loss, mode, n, batch_first=False, draw=draw)


@FEW
@given(sizes=SIZES, batch_first=st.booleans())
@example(sizes=(3, 3), batch_first=False)
def test_multihead_attention_either_layout_is_exact(sizes, batch_first):
    n, t = sizes
    torch.manual_seed(0)
    attention = DPMultiheadAttention(8, 2, add_bias_kv=True, batch_first=batch_first)
    x = torch.randn((n, t, 8) if batch_first else (t, n, 8))
    d = 0 if batch_first else 1
    assert_exact(attention, (x, x, x), (d, d, d), lambda out: projection_loss(out, d), "hooks", n, batch_first=batch_first)


class TokensFlattened(nn.Module):
    """OPT's feed-forward: the (B, T, d) batch flattened to (B * T, d) rows, then viewed back."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, ids):
        h = self.emb(ids)
        shape = h.shape
        flat = h.reshape(-1, h.size(-1))
        return (flat + self.fc(self.norm(flat)).relu()).view(shape)


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
@FEW
@given(sizes=SIZES)
@example(sizes=(3, 3))
def test_batch_merged_with_tokens_is_exact(mode, sizes):
    n, t = sizes
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (n, t), generator=torch.Generator().manual_seed(n * 7 + t))
    assert_exact(TokensFlattened(), (ids,), (0,), projection_loss, mode, n)


class FramesFlattened(nn.Module):
    """A video model's frame encoder: (B, T, C, H, W) clips as B * T images for a Conv2d."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.head = nn.Linear(12, 2)

    def forward(self, clips):
        b, t = clips.shape[:2]
        frames = self.conv(clips.flatten(0, 1)).relu()  # (B * T, 3, 2, 2)
        return self.head(frames.flatten(1).view(b, t, -1))


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
@pytest.mark.parametrize("n,t", [(3, 3), (2, 4), (1, 2)])
def test_batch_merged_with_frames_into_a_conv_is_exact(mode, n, t):
    torch.manual_seed(0)
    assert_exact(FramesFlattened(), (torch.randn(n, t, 2, 4, 4),), (0,), projection_loss, mode, n)


@pytest.mark.parametrize("n,t", [(3, 3), (2, 4)])
def test_merged_batch_is_replayed_per_sample_by_the_functorch_fallback(n, t):
    """Each sample's T rows of the (B * T, d) batch are replayed together."""
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (n, t), generator=torch.Generator().manual_seed(n * 7 + t))
    assert_exact(TokensFlattened(), (ids,), (0,), projection_loss, "functorch", n)


# ------------------------------------------------------------------------------------ refused


class BatchMean(nn.Module):
    """A layer fed a statistic of the whole batch: its per-sample gradients are not defined."""

    def __init__(self, centred: bool):
        super().__init__()
        self.centred = centred
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):  # x: (n, T, 4)
        h = x - x.mean(0, keepdim=True) if self.centred else x.mean(0)  # the latter is (T, 4): T == n rows
        return self.out(self.lin(h) + x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("centred", [False, True])
@settings(max_examples=2, deadline=None, derandomize=True)
@given(n=st.integers(2, 4))
def test_batch_statistics_fed_to_a_layer_are_refused(mode, centred, n):
    model = BatchMean(centred)
    with GradSampleHooks(model, grad_sample_mode=mode):
        with pytest.raises(PerSampleGradientError, match=r"lin \(Linear\).*mixes or merges its samples.*mean"):
            model(torch.randn(n, n, 4))


def test_shared_layer_output_used_outside_the_batch_is_refused():
    """A shared layer output that reaches the loss without meeting the batch has no per-sample split."""

    class Regularised(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.lin = nn.Linear(4, 1)

        def forward(self, x):
            table = self.emb(torch.arange(5))
            return self.lin(x + table[0]).squeeze(-1), table

    model = Regularised()
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        out, table = model(torch.randn(3, 4))
        with pytest.raises(PerSampleGradientError, match=r"emb is called on inputs that carry no batch dimension"):
            (out.sum() + table.pow(2).sum()).backward()
        hooks.clear()


# ------------------------------------------------------------------------------------ the rules


def follow(n, shape, dim, op):
    """The tag of ``op(x)`` for ``x`` batched (strongly) along ``dim``."""
    x = torch.randn(shape)
    with BatchTracker(n, skip=lambda: False, quiet=None) as tracker:
        tracker.put(x, dim)
        out = op(x)
        return tracker.get(out)


@pytest.mark.parametrize("op,shape,dim,want", [
    (lambda x: x.transpose(0, 1), (3, 3, 5), 1, 0),
    (lambda x: x.permute(2, 0, 1), (3, 3, 5), 0, 1),
    (lambda x: x.mT, (3, 3, 3), 2, 1),
    (lambda x: x.T, (3, 3), 0, 1),
    (lambda x: x.movedim(1, -1), (4, 3, 3), 1, 2),
    (lambda x: x.unsqueeze(0).squeeze(0), (3, 3), 1, 1),
    (lambda x: x.view(3, 3, 2, 2), (3, 3, 4), 1, 1),
    (lambda x: x.reshape(3, 3), (3, 3), 0, 0),  # an identity reshape when T == n
    (lambda x: x.flatten(1), (3, 3, 4), 0, 0),
    (lambda x: x @ torch.randn(4, 2), (3, 3, 4), 0, 0),
    (lambda x: torch.randn(3, 3) @ x, (3, 3, 4), 0, 0),
    (lambda x: x + torch.randn(3, 1, 1, 4), (3, 3, 4), 1, 2),
    (lambda x: torch.einsum("ntd,de->tne", x, torch.randn(4, 2)), (3, 3, 4), 0, 1),
    (lambda x: torch.cat([x, x], dim=1), (3, 3, 4), 0, 0),
    (lambda x: torch.stack([x, x]), (3, 3, 4), 1, 2),
    (lambda x: x[:, 0], (3, 3, 4), 0, 0),
    (lambda x: x[..., None, :], (3, 3, 4), 1, 1),
    (lambda x: x.softmax(-1).sum(1), (3, 3, 4), 0, 0),
    (lambda x: x.reshape(9, 4), (3, 3, 4), 0, 0 + 3 * INNER),  # each sample's 3 rows, one after the other
    (lambda x: x.reshape(3, 12), (3, 3, 4), 1, 1 + 4 * INNER),
    (lambda x: x.reshape(9, 4).relu().view(3, 3, 4), (3, 3, 4), 0, 0),
    (lambda x: (x.reshape(9, 4) @ torch.randn(4, 2)).unflatten(0, (3, 3)), (3, 3, 4), 0, 0),
])
def test_rules_follow_the_batch_dim(op, shape, dim, want):
    assert follow(3, shape, dim, op) == want


@pytest.mark.parametrize("op,shape,dim", [
    (lambda x: x.mean(0), (3, 3, 4), 0),
    (lambda x: x.softmax(0), (3, 3, 4), 0),
    (lambda x: x.transpose(0, 1).reshape(9, 4), (3, 3, 4), 0),  # the samples' rows interleaved
    (lambda x: x.reshape(3, 3, 2, 2).flatten(0, 2), (3, 3, 4), 1),
    (lambda x: x.reshape(9, 4).sum(0), (3, 3, 4), 0),
    (lambda x: x.transpose(1, 2) @ x, (3, 3, 3), 1),
    (lambda x: x[0], (3, 3, 4), 0),
    (lambda x: x[:2], (3, 3, 4), 0),
    (lambda x: torch.cat([x, x]), (3, 3, 4), 0),
    (lambda x: x.flip(0), (3, 3, 4), 0),
])
def test_rules_mark_a_lost_batch_dim(op, shape, dim):
    assert isinstance(follow(3, shape, dim, op), Lost)


def test_a_weak_batch_dim_is_taken_as_batched():
    """A root argument with n rows that no draw tells apart from the batch (a (T, T) mask with T == n, or
    a copy of the input) may hold the samples' data: where it agrees with the batch it is batched, and
    where it meets it along another dim, or was mixed over its rows, the result is lost."""
    x, mask = torch.randn(3, 3, 3), torch.randn(3, 3)
    with BatchTracker(3, skip=lambda: False, quiet=None) as tracker:
        tracker.put(x, 0)
        tracker.put(mask, 0 + WEAK)
        assert tracker.get(mask.T) == 1 + WEAK
        assert tracker.get(x + mask[:, None]) == 0
        assert isinstance(tracker.get(x @ x.transpose(1, 2) + mask), Lost)  # the mask's rows along dim 1
        assert isinstance(tracker.get(x.softmax(-1) + mask.T.softmax(0)[None]), Lost)  # its rows mixed
        assert isinstance(tracker.get(x - mask.mean(0)), Lost)
        assert isinstance(tracker.get(mask.softmax(0)), Lost)


@pytest.mark.parametrize("tag", [0, 1, 2 | WEAK, 1 + 3 * INNER, (1 + 3 * INNER) | WEAK])
@pytest.mark.parametrize("n", [1, 4])
def test_a_call_with_one_batched_argument_is_classified_as_with_others(tag, n):
    """The one-argument shortcut of ``classify`` gives what the general rule gives that argument beside an
    untagged one: batched along the tag's dim (weak or not), that tag primary."""
    from dptorch.grad_sample.tracking.tags import classify

    assert classify([tag], n) == ("batched", (tag & ~WEAK,), tag)
    assert classify([tag, None], n) == ("batched", (tag & ~WEAK, None), tag)
