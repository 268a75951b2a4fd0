"""Ghost and book-keeping modes: norms equal instantiated per-sample norms; steps equal hooks steps."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.modes.unit_rows import group_rows_by_unit
from dptorch.grad_sample.capture.dp_loss import DPLoss
from dptorch.noise import NoiseGenerator
from dptorch.optim import DPOptimizer
from tests.grad_sample.test_hf_models import tiny_bert, tiny_gpt2, tiny_llama
from tests.helpers import call, projection_loss


def norms_and_step(model, mode, inputs, loss_fn, *, units=None, C=0.05, clipping="flat"):
    """One DP step (noise seed fixed); returns the per-sample norms seen and the updated model."""
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    if units is not None:
        hooks.set_privacy_units(units)
    max_norm = C if clipping == "flat" else [C] * len([p for p in model.parameters() if p.requires_grad])
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.3, max_grad_norm=max_norm,
                      expected_batch_size=4, clipping=clipping, noise_generator=NoiseGenerator(seed=11))
    seen = {}
    hooks.add_backward_listener(lambda h: seen.update({p: n.clone() for p, n in h.per_sample_norms().items()}))
    output = call(model, inputs)
    if mode == "ghost":
        loss = DPLoss(loss_fn, hooks)(output)
    else:
        loss = loss_fn(output).sum()
    loss.backward()
    opt.step()
    hooks.cleanup()
    return seen, model


def assert_modes_agree(model, inputs, loss_fn, modes=("bk", "ghost"), **kwargs):
    reference_norms, reference = norms_and_step(copy.deepcopy(model), "hooks", inputs, loss_fn, **kwargs)
    names = {p: n for n, p in reference.named_parameters()}
    for mode in modes:
        norms, updated = norms_and_step(copy.deepcopy(model), mode, inputs, loss_fn, **kwargs)
        assert len(norms) == len(reference_norms), mode
        for (name, p_ref), p in zip(reference.named_parameters(), updated.parameters()):
            ref_norm = reference_norms[p_ref]
            got = next(v for k, v in norms.items() if k is p)
            torch.testing.assert_close(got, ref_norm, rtol=1e-4, atol=1e-6, msg=lambda m: f"{mode} {name}: {m}")
            torch.testing.assert_close(p, p_ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{mode} step {name}: {m}")
    return reference_norms


def logits_loss(output):
    return projection_loss(output.logits)


@pytest.mark.parametrize("build", [tiny_gpt2, lambda: tiny_gpt2(tie=False), tiny_llama, tiny_bert], ids=["gpt2-tied", "gpt2-untied", "llama", "bert"])
def test_hf_models_bk_and_ghost_equal_hooks(build):
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, 61, (4, 9))
    assert_modes_agree(model, {"input_ids": ids}, logits_loss)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), t=st.integers(1, 12), d=st.integers(1, 9), p=st.integers(1, 9), bias=st.booleans())
def test_linear_ghost_and_instantiated_norms(n, t, d, p, bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, p, bias=bias), nn.Tanh(), nn.Linear(p, 3))
    assert_modes_agree(model, (torch.randn(n, t, d),), projection_loss)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), t=st.integers(1, 6), vocab=st.sampled_from([3, 50]), pad=st.booleans())
def test_embedding_norms(n, t, vocab, pad):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, 5, padding_idx=0 if pad else None), nn.Linear(5, 2))
    assert_modes_agree(model, (torch.randint(0, vocab, (n, t)),), projection_loss)


def test_layers_without_norm_sampler_fall_back_to_instantiation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.Flatten(), nn.Linear(12, 2))
    assert_modes_agree(model, (torch.randn(3, 2, 4, 4),), projection_loss)


def test_module_called_twice_is_treated_as_shared():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(torch.tanh(self.lin(x)))

    torch.manual_seed(0)
    assert_modes_agree(Twice(), (torch.randn(3, 5, 4),), projection_loss)


def test_per_layer_clipping_in_bk():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    assert_modes_agree(model, (torch.randn(4, 3, 4),), projection_loss, modes=("bk",), clipping="per_layer")


def test_privacy_units_in_every_mode():
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, 61, (6, 5))
    units = torch.tensor([0, 1, 2, 0, 1, 2])  # DPO-style: rows i and i + 3 form one unit
    norms = assert_modes_agree(model, {"input_ids": ids}, logits_loss, units=units)
    assert all(n.shape == (3,) for n in norms.values())


def test_group_rows_by_unit_places_rows_side_by_side():
    x = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3)
    grouped = group_rows_by_unit(x, torch.tensor([5, 9, 5, 7]))
    assert grouped.shape == (3, 4, 3)
    torch.testing.assert_close(grouped[0], torch.cat([x[0], x[2]]))
    torch.testing.assert_close(grouped[1], torch.cat([x[3], torch.zeros(2, 3)]))
    ids = group_rows_by_unit(torch.tensor([[1, 2], [3, 4]]), torch.tensor([0, 0]))
    assert ids.tolist() == [[1, 2, 3, 4]]


def test_dploss_refuses_a_scalar_loss_and_handles_losses_without_reduction():
    model = nn.Linear(4, 3)
    hooks = GradSampleHooks(model, grad_sample_mode="ghost")
    out = model(torch.randn(5, 4))
    target = torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match="one loss per sample"):
        DPLoss(lambda o, t: nn.functional.cross_entropy(o, t), hooks)(out, target)  # a scalar
    per_sample = DPLoss(lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"), hooks)(out, target)
    assert per_sample.per_sample.shape == (5,)
    criterion = nn.CrossEntropyLoss()
    value = DPLoss(criterion, hooks)(out, target)
    assert criterion.reduction == "mean" and value.per_sample.shape == (5,)
    torch.testing.assert_close(value.detach(), nn.functional.cross_entropy(out, target))
    hooks.cleanup()


def test_ghost_loss_arithmetic_equals_hooks_update():
    """A DPO-style objective built from two wrapped losses gives the hooks-mode step."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, target = torch.randn(5, 4), torch.randint(0, 3, (5,))
    results = {}
    for mode in ("hooks", "ghost"):
        model = copy.deepcopy(base)
        hooks = GradSampleHooks(model, grad_sample_mode=mode)
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0,
                          max_grad_norm=0.2, expected_batch_size=5)
        out = model(x)
        ce = nn.CrossEntropyLoss()
        square = lambda o: o.pow(2).sum(1)  # noqa: E731  (an HF-style loss without `reduction`)
        if mode == "ghost":
            loss = 2.0 * DPLoss(ce, hooks)(out, target) - DPLoss(square, hooks)(out) / 4 + -DPLoss(ce, hooks)(out, target)
        else:
            per_sample = 2.0 * nn.functional.cross_entropy(out, target, reduction="none") - square(out) / 4 - nn.functional.cross_entropy(out, target, reduction="none")
            loss = per_sample.mean()
        loss.backward()
        opt.step()
        hooks.cleanup()
        results[mode] = [p.detach() for p in model.parameters()]
    for a, b in zip(results["hooks"], results["ghost"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ghost_loss_arithmetic_refuses_mismatched_batches():
    model = nn.Linear(4, 3)
    hooks = GradSampleHooks(model, grad_sample_mode="ghost")
    first = DPLoss(nn.CrossEntropyLoss(), hooks)(model(torch.randn(3, 4)), torch.zeros(3, dtype=torch.long))
    second = DPLoss(nn.CrossEntropyLoss(), hooks)(model(torch.randn(2, 4)), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="same batch"):
        first + second
    hooks.cleanup()


def test_tied_embedding_is_not_instantiated_in_bk():
    torch.manual_seed(0)
    model = tiny_gpt2(tie=True)
    with GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum") as hooks:
        logits_loss(model(input_ids=torch.randint(0, 61, (2, 5)))).sum().backward()
        assert model.lm_head.weight not in hooks.grad_samples  # norm from the factors (cross terms)
        assert model.lm_head.weight in hooks.per_sample_norms()
