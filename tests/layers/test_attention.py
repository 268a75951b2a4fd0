"""DPMultiheadAttention: equivalence with nn.MultiheadAttention, its state_dict, per-sample oracle."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from dptorch.layers import DPMultiheadAttention
from dptorch.validate import ModuleValidator
from tests.helpers import check_per_sample_grads

E, HEADS, N, L, S = 8, 2, 3, 4, 5


def make_pair(**config):
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(E, HEADS, dtype=torch.float64, **config)
    dp = DPMultiheadAttention(E, HEADS, dtype=torch.float64, **config)
    dp.load_state_dict(reference.state_dict(), strict=True)
    return reference, dp


def qkv(batch_first: bool, kdim: int = E, vdim: int = E, dtype=torch.float64):
    shape = (lambda length, dim: (N, length, dim)) if batch_first else (lambda length, dim: (length, N, dim))
    return torch.randn(shape(L, E), dtype=dtype), torch.randn(shape(S, kdim), dtype=dtype), torch.randn(shape(S, vdim), dtype=dtype)


def masks():
    g = torch.Generator().manual_seed(1)
    padding = torch.rand(N, S, generator=g) < 0.4
    padding[:, 0] = False
    attn = torch.rand(L, S, generator=g) < 0.4
    attn[:, 0] = False
    return [
        {},
        dict(key_padding_mask=padding),
        dict(key_padding_mask=torch.randn(N, S, generator=g, dtype=torch.float64)),
        dict(attn_mask=attn),
        dict(attn_mask=torch.randn(N * HEADS, L, S, generator=g, dtype=torch.float64)),
        dict(attn_mask=attn, key_padding_mask=padding),
    ]


CONFIGS = [
    dict(bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=dim, vdim=dim + 1 if dim else None, batch_first=batch_first)
    for bias, bias_kv, zero_attn, dim, batch_first in itertools.product([True, False], [False, True], [False, True], [None, 6], [False, True])
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_outputs_equal_torch(config):
    reference, dp = make_pair(**config)
    q, k, v = qkv(config["batch_first"], config["kdim"] or E, config["vdim"] or E)
    for mask, need_weights, average in itertools.product(masks(), [True, False], [True, False]):
        expected = reference(q, k, v, need_weights=need_weights, average_attn_weights=average, **mask)
        got = dp(q, k, v, need_weights=need_weights, average_attn_weights=average, **mask)
        torch.testing.assert_close(got[0], expected[0])
        if need_weights:
            torch.testing.assert_close(got[1], expected[1])
        else:
            assert got[1] is None


def test_gradients_equal_torch():
    reference, dp = make_pair(add_bias_kv=True, batch_first=True)
    q, k, v = qkv(True)
    reference(q, k, v)[0].pow(2).sum().backward()
    dp(q, k, v)[0].pow(2).sum().backward()
    for name, grad in zip(("q_proj", "k_proj", "v_proj"), reference.in_proj_weight.grad.chunk(3)):
        torch.testing.assert_close(getattr(dp, name).weight.grad, grad)
    for name, grad in zip(("q_proj", "k_proj", "v_proj"), reference.in_proj_bias.grad.chunk(3)):
        torch.testing.assert_close(getattr(dp, name).bias.grad, grad)
    torch.testing.assert_close(dp.bias_k.grad, reference.bias_k.grad)
    torch.testing.assert_close(dp.bias_v.grad, reference.bias_v.grad)
    torch.testing.assert_close(dp.out_proj.weight.grad, reference.out_proj.weight.grad)


@pytest.mark.parametrize("need_weights", [True, False])
def test_is_causal(need_weights):
    reference, dp = make_pair(batch_first=True)
    x = torch.randn(N, L, E, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    expected = reference(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)[0]
    torch.testing.assert_close(dp(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)[0], expected)
    torch.testing.assert_close(dp(x, x, x, is_causal=True, need_weights=need_weights)[0], expected)


def test_unbatched_input():
    reference, dp = make_pair(add_bias_kv=True)
    q, k, v = torch.randn(L, E, dtype=torch.float64), torch.randn(S, E, dtype=torch.float64), torch.randn(S, E, dtype=torch.float64)
    padding = torch.tensor([False, True, False, False, True])
    for a, b in zip(reference(q, k, v, key_padding_mask=padding), dp(q, k, v, key_padding_mask=padding)):
        torch.testing.assert_close(b, a)


def test_dropout_only_in_training():
    reference, dp = make_pair(dropout=0.5, batch_first=True)
    q, k, v = qkv(True)
    reference.eval(), dp.eval()
    torch.testing.assert_close(dp(q, k, v)[0], reference(q, k, v)[0])
    dp.train()
    assert not torch.allclose(dp(q, k, v)[0], reference(q, k, v)[0])


def test_torch_state_dict_layouts_load():
    for config in (dict(), dict(kdim=6, vdim=7), dict(bias=False, add_bias_kv=True)):
        reference = nn.MultiheadAttention(E, HEADS, **config)
        dp = DPMultiheadAttention(E, HEADS, **config)
        assert dp.load_state_dict(reference.state_dict(), strict=True)
        if reference._qkv_same_embed_dim:
            torch.testing.assert_close(torch.cat([dp.q_proj.weight, dp.k_proj.weight, dp.v_proj.weight]), reference.in_proj_weight)
        else:
            torch.testing.assert_close(dp.k_proj_weight, reference.k_proj_weight)
        dp.load_state_dict(dp.state_dict(), strict=True)  # its own layout still loads


def test_initialisation_follows_torch():
    dp = DPMultiheadAttention(64, 4, add_bias_kv=True)
    bound = (6 / (64 + 3 * 64)) ** 0.5
    assert dp.q_proj.weight.abs().max() <= bound and dp.q_proj.weight.abs().max() > 0.8 * bound
    assert torch.count_nonzero(dp.q_proj.bias) == 0 and torch.count_nonzero(dp.out_proj.bias) == 0
    assert dp.bias_k.shape == (1, 1, 64) and dp.bias_v is dp.value_bias.weight


ORACLE_CONFIGS = [
    dict(),
    dict(add_bias_kv=True, add_zero_attn=True),
    dict(kdim=6, vdim=7, bias=False),
]


@pytest.mark.parametrize("config", ORACLE_CONFIGS)
@pytest.mark.parametrize("need_weights", [True, False])
def test_per_sample_gradients_match_oracle(config, need_weights):
    torch.manual_seed(2)
    dp = DPMultiheadAttention(E, HEADS, batch_first=True, **config)
    q, k, v = qkv(True, config.get("kdim", E), config.get("vdim", E), dtype=torch.float32)
    padding = torch.zeros(N, S, dtype=torch.bool)
    padding[0, -2:] = True
    attn = torch.rand(L, S) < 0.3
    attn[:, 0] = False
    inputs = dict(query=q, key=k, value=v, key_padding_mask=padding, attn_mask=attn, need_weights=need_weights)
    check_per_sample_grads(dp, inputs)


def test_per_sample_gradients_with_frozen_bias_k():
    dp = DPMultiheadAttention(E, HEADS, batch_first=True, add_bias_kv=True)
    dp.bias_k.requires_grad_(False)
    dp.q_proj.weight.requires_grad_(False)
    q, k, v = qkv(True, dtype=torch.float32)
    check_per_sample_grads(dp, (q, k, v))


def test_time_major_layer_inside_a_batch_first_model():
    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = DPMultiheadAttention(E, HEADS, add_bias_kv=True)  # batch_first=False

        def forward(self, x):  # x: (N, L, E)
            time_major = x.transpose(0, 1)
            return self.attention(time_major, time_major, time_major)[0].transpose(0, 1)

    check_per_sample_grads(SelfAttention(), (torch.randn(N, L, E),))


def test_fixed_transformer_encoder():
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    fixed = ModuleValidator.fix(encoder)
    assert all(isinstance(block.self_attn, DPMultiheadAttention) for block in fixed.layers)
    x = torch.randn(N, L, E)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[1, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    for kwargs in (dict(), dict(src_key_padding_mask=padding), dict(mask=causal, is_causal=True)):
        torch.testing.assert_close(fixed(x, **kwargs), encoder(x, **kwargs))
    fixed.eval(), encoder.eval()
    with torch.no_grad():  # torch's inference fast path, through in_proj_weight and merge_masks
        got, expected = fixed(x, src_key_padding_mask=padding), encoder(x, src_key_padding_mask=padding)
        torch.testing.assert_close(got[~padding], expected[~padding])
    fixed.train()
    check_per_sample_grads(fixed, (x,))
    boolean_causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    check_per_sample_grads(fixed, (x, boolean_causal, padding), loss_fn=lambda out: (out * torch.arange(E)).sum((1, 2)))


@pytest.mark.parametrize("config", [dict(), dict(kdim=6, vdim=7), dict(bias=False, add_bias_kv=True), dict(add_bias_kv=True)])
def test_its_state_dict_is_torchs_layout_and_loads_into_torchs_layer(config):
    torch.manual_seed(0)
    dp = DPMultiheadAttention(E, HEADS, **config)
    reference = nn.MultiheadAttention(E, HEADS, **config)
    saved = dp.state_dict()
    assert list(saved) == list(reference.state_dict())
    assert all(saved[k].shape == v.shape for k, v in reference.state_dict().items())
    reference.load_state_dict(saved, strict=True)
    q, k, v = qkv(False, reference.kdim, reference.vdim, dtype=torch.float32)
    torch.testing.assert_close(reference(q, k, v)[0], dp(q, k, v)[0])
    nested = nn.Sequential(DPMultiheadAttention(E, HEADS, **config))
    assert all(key.startswith("0.") for key in nested.state_dict())
    nested.load_state_dict({"0." + key: value for key, value in saved.items()}, strict=True)
    torch.testing.assert_close(nested[0].q_proj.weight, dp.q_proj.weight)
