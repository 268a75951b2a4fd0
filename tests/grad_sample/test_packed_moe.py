"""Mixture-of-experts models with packed examples (token privacy units), against each example alone.

An MoE block flattens its ``(B, T, H)`` input to ``(B * T, H)`` token rows, routes them (the router
has no grad sampler: the torch.func fallback replays it one token at a time), runs the expert bank
and unflattens. Each packed example's norm and clipped sum must equal that example's own gradient
in its own unpadded row; a block that mixes the flattened tokens is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptorch import packed_loss
from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError
from dptorch.integrations.hf.packing import PackingCollator
from dptorch.integrations.hf.sampling import UNIT_IDS_KEY
from tests.grad_sample.test_token_units import VOCAB, assert_matches, examples

transformers = pytest.importorskip("transformers")

FAMILIES = ("mixtral", "qwen2_moe", "olmoe")


def moe(family: str) -> nn.Module:
    """Two decoder layers of a tiny MoE model (three experts, top 2; no auxiliary loss), sdpa attention."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, num_experts_per_tok=2, max_position_embeddings=32, router_aux_loss_coef=0.0,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=3, router_jitter_noise=0.0,
                                                                           **common))
    elif family == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=3, moe_intermediate_size=24, shared_expert_intermediate_size=24, **common))
    else:
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=3, **common))
    model.config._attn_implementation = "sdpa"
    return model.train()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["bk", "hooks", "ghost"])
def test_packed_moe_matches_each_example_alone(family, mode):
    items = examples([5, 3, 4, 2, 6])
    assert_matches(moe(family), PackingCollator(pad_token_id=0, max_length=8)(items), items, mode)


def test_padding_free_moe_matches_each_example_alone():
    items = examples([5, 3, 4])
    assert_matches(moe("qwen2_moe"), PackingCollator(pad_token_id=0, max_length=None)(items), items, "bk")


class _MixingRouter(nn.Module):
    """A router whose scores are normalised over all the flattened tokens: it couples the packed examples."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.weight = router.weight
        self.top_k = router.top_k

    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits - logits.mean(0, keepdim=True), dim=-1)
        scores, index = torch.topk(probs, self.top_k, dim=-1)
        return logits, scores, index


class _UnflattenAnotherWay(nn.Module):
    """An MoE block that unflattens its token rows otherwise than it flattened them: in ``(T, B)`` order (token
    rows reach other examples' places), or through a shape of pairs of tokens that the tracker does not follow."""

    def __init__(self, block: nn.Module, how: str):
        super().__init__()
        self.block, self.how = block, how

    def forward(self, hidden_states):
        rows, tokens, hidden = hidden_states.shape
        flat = hidden_states.view(-1, hidden)
        _, weights, index = self.block.gate(flat)
        out = self.block.experts(flat, index, weights)
        if self.how == "transposed":
            return out.view(tokens, rows, hidden).transpose(0, 1)
        if self.how == "shaped":  # routes rows of the right count that are no token's: its shape, not its data
            _, weights, index = self.block.gate(flat.new_ones(rows * tokens, hidden))
            return self.block.experts(flat, index, weights).view(rows, tokens, hidden)
        return out.view(rows * tokens // 2, 2 * hidden).view(rows, tokens, hidden)


@pytest.mark.parametrize("how, match", [
    ("router", "do not keep each packed token apart"),
    ("transposed", "mixes or merges its samples|one packed example's data"),
    ("pairs", "flattened with their rows, other than its inverse"),
    ("shaped", "do not keep each packed token apart"),
])
def test_a_moe_block_that_mixes_flattened_tokens_is_refused(how, match):
    model = moe("mixtral")
    layer = model.model.layers[0]
    if how == "router":
        layer.mlp.gate = _MixingRouter(layer.mlp.gate)
    else:
        layer.mlp = _UnflattenAnotherWay(layer.mlp, how)
    batch = PackingCollator(pad_token_id=0, max_length=8)(examples([5, 3, 4, 2]))
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    try:
        hooks.set_privacy_units(batch[UNIT_IDS_KEY])
        with pytest.raises(PerSampleGradientError, match=match):
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            packed_loss(out.logits, batch["labels"], hooks).backward()
        assert all(p.grad is None for p in model.parameters())
    finally:
        hooks.cleanup()


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_routers_are_sampled_as_linear_layers_not_replayed_per_token(monkeypatch, mode):
    """The router's weight gradient is a linear layer's over (tokens, hidden) rows (``linear_head``): the per-token
    replay, which would hold a (hidden x experts) gradient per token, never runs."""
    import dptorch.grad_sample.capture.replays as replays_module

    def no_replay(*args, **kwargs):
        raise AssertionError("the router was replayed per token")

    monkeypatch.setattr(replays_module, "functorch_per_sample_grads", no_replay)
    items = examples([5, 3, 4, 2])
    assert_matches(moe("olmoe"), PackingCollator(pad_token_id=0, max_length=8)(items), items, mode)


@pytest.mark.parametrize("mode", ["bk", "hooks", "ghost"])
def test_routers_of_row_units_are_sampled_as_linear_layers_too(monkeypatch, mode):
    """Unpacked (one sample per row), the router is a bias-free linear layer on the (B * T, H) rows as well,
    exact against each sample alone, with the torch.func replay disabled."""
    import dptorch.grad_sample.capture.replays as replays_module
    from tests.grad_sample.oracle import assert_exact
    from tests.models.zoo import ZOO

    def no_replay(*args, **kwargs):
        raise AssertionError("the router was replayed per sample")

    monkeypatch.setattr(replays_module, "functorch_per_sample_grads", no_replay)
    torch.manual_seed(0)
    model = ZOO["mixtral"].build()
    inputs = ZOO["mixtral"].inputs(3, 5, torch.Generator().manual_seed(7))
    assert_exact(model, inputs, {k: 0 for k in inputs}, ZOO["mixtral"].loss, mode, 3)


def _router(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(hidden_size=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=8)
    router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
    nn.init.normal_(router.weight)
    return router


def _head(router: nn.Module, x: torch.Tensor, grads):
    from torch.utils._pytree import tree_flatten

    from dptorch.grad_sample.modes.linear_head import linear_head

    leaves, spec = tree_flatten(((x,), {}))
    return linear_head(router, router.weight, leaves, spec, grads)


def test_linear_head_finds_the_gradient_at_the_routers_logits():
    router, x = _router(), torch.randn(2, 5, 8)
    g_logits, g_scores = torch.randn(10, 4), torch.randn(10, 2)
    head = _head(router, x, [(0, g_logits), (1, g_scores)])
    assert head is not None and head[0] == 0 and head[1].shape == (10, 8)  # a view of the call's first input
    logits = nn.functional.linear(x.reshape(-1, 8), router.weight).detach().requires_grad_()
    scores = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).values
    scores = scores / scores.sum(-1, keepdim=True)
    (want,) = torch.autograd.grad((logits * g_logits).sum() + (scores * g_scores).sum(), logits)
    torch.testing.assert_close(head[2], want)


class _ReadsTwice(nn.Module):
    def __init__(self, router):
        super().__init__()
        self.weight = router.weight

    def forward(self, x):
        return nn.functional.linear(x, self.weight) + self.weight.sum()


class _Noisy(_ReadsTwice):
    def forward(self, x):
        return nn.functional.dropout(nn.functional.linear(x, self.weight), 0.5)


class _Rolled(_ReadsTwice):
    def forward(self, x):
        return nn.functional.linear(x.roll(1, 0), self.weight)


class _PoissonNoise(_ReadsTwice):
    """A random operation no name lists, drawing from the default generator."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight) + torch.poisson(x.abs())[:, :4]


class _OwnGenerator(_ReadsTwice):
    """A random operation drawing from a generator of its own (the default generators untouched)."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight) + torch.poisson(x.abs(), generator=torch.Generator())[:, :4]


@pytest.mark.parametrize("kind", [_ReadsTwice, _Noisy, _Rolled, _PoissonNoise, _OwnGenerator])
def test_linear_head_declines_what_is_not_one_linear_of_its_input(kind):
    """A weight read twice, random operations (by name, by the default generator's state, by a generator
    argument), a linear input that is not the call's input row by row."""
    x = torch.randn(6, 8)
    assert _head(kind(_router()), x, [(0, torch.randn(6, 4))]) is None


def test_a_declined_module_is_not_recomputed_again():
    module, calls = _ReadsTwice(_router()), []
    forward = module.forward
    module.forward = lambda x: (calls.append(1), forward(x))[1]
    x = torch.randn(6, 8)
    assert _head(module, x, [(0, torch.randn(6, 4))]) is None and len(calls) == 1
    assert _head(module, x, [(0, torch.randn(6, 4))]) is None and len(calls) == 1
