"""Fast paths stay exact: transposed output gradients made contiguous at the tap, per-sample
gradients summed in place only into memory the controller owns."""

import weakref

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks, register_grad_sampler
from dptorch.grad_sample.layers.linear import linear_map_grad_samples
from tests.grad_sample.test_fast_clipping import assert_modes_agree
from tests.grad_sample.test_shared_inputs import TiedLM
from tests.helpers import check_per_sample_grads, projection_loss


def transposed_loss(output):
    """A per-sample loss read through ``(B, V, T)``: its gradient reaches the head transposed."""
    return projection_loss(output.transpose(1, 2))


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_transposed_output_gradient_is_exact(mode):
    torch.manual_seed(0)
    check_per_sample_grads(TiedLM(11, 6, None), (torch.randint(0, 11, (3, 5)),), loss_fn=transposed_loss, grad_sample_mode=mode)


def test_transposed_output_gradient_bk_equals_hooks():
    torch.manual_seed(0)
    assert_modes_agree(TiedLM(11, 6, 0), (torch.randint(0, 11, (3, 5)),), transposed_loss)


class KeepingLinear(nn.Linear):
    """A Linear whose (custom) sampler keeps a reference to what it returns."""


@register_grad_sampler(KeepingLinear)
def _keeping_sampler(module, activations, backprops):
    grads = linear_map_grad_samples(module.weight, module.bias, activations[0], backprops)
    module.kept = {p: g for p, g in grads.items()}
    module.kept_copy = {p: g.clone() for p, g in grads.items()}
    return grads


def test_tied_rows_never_written_into_a_samplers_tensor():
    torch.manual_seed(0)
    model = TiedLM(11, 6, None)
    head = KeepingLinear(6, 11, bias=False)
    head.weight = model.emb.weight
    model.head = head
    ids = torch.randint(0, 11, (3, 5))
    got = check_per_sample_grads(model, (ids,))
    kept = head.kept[head.weight]
    assert torch.equal(kept, head.kept_copy[head.weight])  # the sampler's tensor is untouched
    assert not torch.equal(got[head.weight], kept)  # the embedding rows were added to a copy


def test_a_rounds_per_sample_gradients_survive_the_next_round():
    torch.manual_seed(0)
    model = TiedLM(11, 6, None)
    ids = torch.randint(0, 11, (3, 5))
    with GradSampleHooks(model) as hooks:
        projection_loss(model(ids)).mean().backward()
        first = hooks.grad_samples
        saved = {p: g.clone() for p, g in first.items()}
        hooks.clear()
        projection_loss(model(ids.flip(0))).mean().backward()
        for p, g in first.items():
            assert torch.equal(g, saved[p])


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_long_sequences_instantiate_and_sum_what_the_norms_built(clipping):
    """T (d + p) > d p: every Linear / Conv1D norm is instantiated, and its clipped sum read from it."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=40, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 13, (3, 30))
    assert_modes_agree(model, {"input_ids": ids}, lambda out: projection_loss(out.logits), clipping=clipping)
    mlp = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3, bias=False))
    assert_modes_agree(mlp, (torch.randn(5, 40, 4),), projection_loss, clipping=clipping)


def test_a_mean_loss_scale_applied_after_the_sampler_is_exact():
    """T > d: the batch-size scale of a mean loss goes on the per-sample gradients, not on b."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    check_per_sample_grads(mlp, (torch.randn(5, 40, 4),), loss_reduction="mean")
    model, ids = TiedLM(7, 3, None), torch.randint(0, 7, (4, 30))  # the tied head: instantiated in bk too
    norms = {}
    for mode in ("hooks", "bk"):
        with GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="mean") as hooks:
            projection_loss(model(ids)).mean().backward()
            norms[mode] = hooks.per_sample_norms()
    for p, want in norms["hooks"].items():
        torch.testing.assert_close(norms["bk"][p], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width, tokens, kept", [(4, 6, True), (64, 3, False)])
def test_kept_gradients_take_their_calls_factors_place(width, tokens, kept):
    """A Linear whose per-sample gradient bk keeps (``d p`` numbers, no more than the ``T (d + p)`` of its
    input and output gradient) lets those go once the norms are formed; a ghost-norm Linear holds them for its
    clipped sum. Both clip as hooks do."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    seen = []
    mlp[2].register_forward_pre_hook(lambda module, args: seen.append(weakref.ref(args[0])))
    with GradSampleHooks(mlp, grad_sample_mode="bk", loss_reduction="sum") as hooks:
        projection_loss(mlp(torch.randn(3, tokens, width))).sum().backward()
        assert seen[0]() is not None
        hooks.per_sample_norms()
        assert (seen[0]() is None) == kept
    assert_modes_agree(mlp, (torch.randn(3, tokens, width),), projection_loss)
