"""The facts the captured-step route stands on (docs/architecture.md, "capture the whole step"), pinned so that a
torch upgrade that breaks one is seen: ``make_fx`` in fake-tensor mode traces a bk step under the live batch
tracker, the tracker refuses a step whose samples meet at the trace, and the graph replays the eager clipped sums
with the parameters read by reference, embeddings (their (sample, row) pairs in slots of static shape) and a tied head
included.""" 

import warnings

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import transformers

from dptorch.clipping.factors import clip_factors
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError
from tests.engine.test_compile_after_wrap import Mixing


def capture(step, *inputs):
    return make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)


def clipped_step(model, hooks, loss_of, clip=0.5):
    """Forward, backward, per-sample norms, clip factors and clipped sums, as one function of the batch."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step(*batch):
        loss_of(model, *batch).backward()
        norms = hooks.per_sample_norms()
        factors = clip_factors(torch.stack([norms[p].double() for p in params]).pow(2).sum(0).sqrt(), clip)
        sums = hooks.clipped_sums({p: factors for p in params})
        hooks.clear()
        return [sums[p] for p in params]

    return step


def tiny_gpt2():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        tie_word_embeddings=True))
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def lm_loss(model, ids):
    """Position ids given per row: GPT-2's own ``(1, T)`` positions meet the batch as a shared tensor, whose
    per-sample gradients are checked against its total by value (``tracking/origins.py``): not traceable."""
    positions = torch.arange(ids.shape[1]).expand(ids.shape).contiguous()
    logits = model(input_ids=ids, position_ids=positions).logits
    return nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="sum")


def test_a_captured_bk_step_replays_the_eager_clipped_sums_and_reads_the_parameters_by_reference():
    model = tiny_gpt2().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    step = clipped_step(model, hooks, lm_loss)
    try:
        ids = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(1))
        graph = capture(step, ids)
        assert not any(n.op == "call_module" for n in graph.graph.nodes)  # ATen operations only
        for seed in (2, 3):  # later batches of the traced shape
            batch = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                replayed = graph(batch)
            for got, want in zip(replayed, step(batch)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            with torch.no_grad():  # an update in place, as an optimizer makes it: the graph reads the new values
                torch._foreach_add_([p for p in model.parameters() if p.requires_grad], replayed, alpha=-0.1)
    finally:
        hooks.cleanup()


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_a_step_whose_samples_meet_is_refused_at_the_capture(mode):
    model = Mixing()  # a mean over the batch between two layers
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    try:
        with pytest.raises(PerSampleGradientError, match="mixes or merges its samples"):
            capture(clipped_step(model, hooks, lambda m, x: m(x).pow(2).sum()), torch.randn(4, 6))
    finally:
        hooks.cleanup()


def test_an_embedding_step_with_repeated_ids_replays_the_eager_clipped_sums():
    """Rows repeated within a sample and across samples (their pairs), and padding past the pairs, traced once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 2))
    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum")
    step = clipped_step(model, hooks, lambda m, ids: m(ids).pow(2).sum())
    try:
        graph = capture(step, torch.randint(0, 10, (3, 4)))
        for ids in (torch.tensor([[1, 1, 1, 1], [1, 2, 1, 2], [0, 3, 9, 3]]), torch.randint(0, 10, (3, 4))):
            with torch.no_grad():
                replayed = graph(ids)
            for got, want in zip(replayed, step(ids)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    finally:
        hooks.cleanup()
