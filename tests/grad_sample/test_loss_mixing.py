"""Samples meet only in the final reduction of their own loss terms (tracking/loss.py).

The tracker follows the user's loss from the root forward to ``backward()``: a loss that is the
sum (or, with ``loss_reduction="mean"``, the mean) of per-sample terms trains, exactly as the
batch-of-one reference; anything that couples samples (after the last layer or in the loss) is
refused at ``backward()``, before any gradient reaches the controller or a parameter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptorch import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError
from tests.helpers import reference_per_sample_grads, single_thread  # noqa: F401

MODES = ["hooks", "bk", "ghost", "functorch", "ew"]
N = 8


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)


def _grad_samples(mode, loss_reduction, loss_of):
    model = _model()
    x, y = _data()
    with GradSampleHooks(model, loss_reduction=loss_reduction, grad_sample_mode=mode) as hooks:
        loss_of(model(x), y).backward()
        if mode in ("bk", "ghost"):  # book-keeping instantiates nothing: compare what the optimizer asks for
            return model, x, y, hooks.per_sample_norms()
        return model, x, y, {p: g.clone() for p, g in hooks.grad_samples.items()}


# ------------------------------------------------------------------------------- what trains

PER_SAMPLE_LOSSES = {
    "sum": ("sum", lambda out, y: F.cross_entropy(out, y, reduction="sum")),
    "none-then-sum": ("sum", lambda out, y: F.cross_entropy(out, y, reduction="none").sum()),
    "sum-by-constant": ("sum", lambda out, y: F.cross_entropy(out, y, reduction="none").sum() / 4 * 3),
    "sum-of-two-terms": ("sum", lambda out, y: F.cross_entropy(out, y, reduction="sum") - 0.5 * (out ** 2).sum()),
    "mean": ("mean", lambda out, y: F.cross_entropy(out, y)),
    "mean-of-none": ("mean", lambda out, y: F.cross_entropy(out, y, reduction="none").mean()),
    "mse-mean": ("mean", lambda out, y: F.mse_loss(out, F.one_hot(y, 3).float())),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PER_SAMPLE_LOSSES))
def test_a_sum_or_mean_of_per_sample_terms_trains_exactly(mode, name):
    reduction, loss_of = PER_SAMPLE_LOSSES[name]
    model, x, y, got = _grad_samples(mode, reduction, loss_of)

    def own_loss(out):  # "mean": the controller undoes the batch's 1/N, so a sample alone is the reference
        i = own_loss.i
        own_loss.i += 1
        return loss_of(out, y[i : i + 1])

    own_loss.i = 0
    want = reference_per_sample_grads(model, (x,), own_loss)
    for p, ref in want.items():
        if mode in ("bk", "ghost"):
            torch.testing.assert_close(got[p], ref.flatten(1).norm(dim=1), rtol=1e-4, atol=1e-6)
        else:
            torch.testing.assert_close(got[p], ref, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------- what is refused

def _contrastive(out, y):
    return F.cross_entropy(out @ out.T, torch.arange(out.shape[0]), reduction="sum")


def _batch_norm_after_last_layer(out, y):
    return F.cross_entropy(F.batch_norm(out, None, None, training=True), y, reduction="sum")


def _scaled_by_first_row(out, y):
    return F.cross_entropy(out * torch.tanh(50 * out[:1].detach()), y, reduction="sum")


def _column_shifted_by_batch_sum(out, y):
    out = out.clone()
    out[:, 0] += out[:, 1].sum()
    return F.cross_entropy(out, y, reduction="sum")


def _divided_by_batch_statistic(out, y):
    return F.cross_entropy(out, y, reduction="none").sum() / out.detach().abs().sum()


def _normalised_by_its_own_value(out, y):
    loss = F.cross_entropy(out, y, reduction="sum")
    return loss / loss.item()


def _ignored_targets_mean(out, y):
    return F.cross_entropy(out, torch.where(y == 0, -100, y))  # divides by the count of targets kept


def _class_weighted_mean(out, y):
    return F.cross_entropy(out, y, weight=torch.tensor([1.0, 2.0, 3.0]))  # divides by the targets' summed weights


def _log_of_total(out, y):
    return F.cross_entropy(out, y, reduction="sum").log()


def _batch_level_baseline(out, y):
    per = F.cross_entropy(out, y, reduction="none")
    return (per - per.mean()).pow(2).sum()


REFUSED = {
    "contrastive": ("sum", _contrastive),
    "batch-norm-after-last-layer": ("sum", _batch_norm_after_last_layer),
    "scaled-by-first-row": ("sum", _scaled_by_first_row),
    "column-shifted-by-batch-sum": ("sum", _column_shifted_by_batch_sum),
    "divided-by-batch-statistic": ("sum", _divided_by_batch_statistic),
    "normalised-by-its-own-value": ("sum", _normalised_by_its_own_value),
    "ignored-targets-mean": ("mean", _ignored_targets_mean),
    "class-weighted-mean": ("mean", _class_weighted_mean),
    "log-of-total": ("sum", _log_of_total),
    "batch-level-baseline": ("sum", _batch_level_baseline),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_loss_that_couples_samples_is_refused_at_backward(mode, name):
    reduction, loss_of = REFUSED[name]
    model = _model()
    x, y = _data()
    with GradSampleHooks(model, loss_reduction=reduction, grad_sample_mode=mode) as hooks:
        loss = loss_of(model(x), y)
        with pytest.raises(PerSampleGradientError, match="backward"):
            loss.backward()
        assert all(p.grad is None for p in model.parameters())  # refused before any gradient formed
        assert not hooks.grad_samples


def test_a_mean_under_loss_reduction_sum_is_refused_naming_the_keyword():
    model = _model()
    x, y = _data()
    with GradSampleHooks(model, loss_reduction="sum"):
        loss = F.cross_entropy(model(x), y)
        with pytest.raises(PerSampleGradientError, match="loss_reduction='mean'"):
            loss.backward()


SUMMED = {
    "reduction-sum": lambda out, y: F.cross_entropy(out, y, reduction="sum"),
    "none-then-sum": lambda out, y: F.cross_entropy(out, y, reduction="none").sum(),
    "sum-divided-by-a-constant": lambda out, y: F.cross_entropy(out, y, reduction="sum") / N,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(SUMMED))
def test_a_sum_under_loss_reduction_mean_is_refused_naming_the_keyword(mode, name):
    """The controller would multiply each unit's gradient by the drawn batch size before clipping."""
    model = _model()
    x, y = _data()
    with GradSampleHooks(model, loss_reduction="mean", grad_sample_mode=mode) as hooks:
        loss = SUMMED[name](model(x), y)
        with pytest.raises(PerSampleGradientError, match="loss_reduction='mean'.*Pass loss_reduction='sum'"):
            loss.backward()
        assert all(p.grad is None for p in model.parameters())  # refused before any gradient formed
        assert not hooks.grad_samples


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_the_engine_refuses_a_sum_under_its_default_mean_before_any_parameter_changes(mode):
    model = _model()
    x, y = _data()
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=N),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
    )
    before = [p.detach().clone() for p in model.parameters()]
    xb, yb = next(iter(loader))
    while len(xb) < 2:  # a Poisson batch of one: its sum is its mean
        xb, yb = next(iter(loader))
    with pytest.raises(PerSampleGradientError, match="loss_reduction='sum'"):
        F.cross_entropy(model(xb), yb, reduction="sum").backward()
    for p, b in zip(model.parameters(), before):
        assert p.grad is None and torch.equal(p.detach(), b)


# ------------------------------------------------------------------------------- the engine and HF

def _private():
    """A model made private with noise 0 on a loader of all N rows (q = 1), loss_reduction="sum"."""
    model = _model()
    x, y = _data()
    return PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=N),
        noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum",
    )


def test_the_engine_refuses_a_coupling_loss_before_any_parameter_changes():
    model, optimizer, loader = _private()
    before = [p.detach().clone() for p in model.parameters()]
    xb, yb = next(iter(loader))
    while len(xb) < 2:  # a Poisson batch of one cannot couple anything
        xb, yb = next(iter(loader))
    with pytest.raises(PerSampleGradientError):
        _contrastive(model(xb), yb).backward()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _rows():
    """8 rows of 12 tokens: one with 11 target tokens, seven with 2 (the rest ignored)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (8, 12), generator=g)
    labels = torch.full_like(ids, -100)
    labels[0] = ids[0]
    labels[1:, :3] = ids[1:, :3]
    return ids, labels


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_the_built_in_loss_of_a_hf_model_is_refused_with_the_per_sample_way_out(mode):
    model = _tiny_gpt2()
    ids, labels = _rows()
    with GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=mode):
        out = model(input_ids=ids, labels=labels)
        with pytest.raises(PerSampleGradientError, match="ignore_index.*out.logits"):
            out.loss.backward()


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_hf_model_given_labels_trains_on_a_per_sample_loss_of_its_logits(mode):
    model = _tiny_gpt2()
    ids, labels = _rows()
    with GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=mode) as hooks:
        out = model(input_ids=ids, labels=labels)  # out.loss is a batch mean; it is not what backward uses
        out.logits.sum().backward()
        norms = hooks.per_sample_norms()
    assert all(n.shape == (8,) and torch.isfinite(n).all() for n in norms.values())


# ------------------------------------------------------------------------------- the mode stack

def test_a_second_forward_before_backward_is_followed_too():
    depth = torch._C._len_torch_function_stack()
    model = _model()
    x, y = _data()
    with GradSampleHooks(model, loss_reduction="sum"):
        first = model(x)
        second = model(x.flip(-1))
        loss = ((second - first.mean(0)) ** 2).sum()  # the first forward's batch mean meets the second's rows
        with pytest.raises(PerSampleGradientError):
            loss.backward()
    assert torch._C._len_torch_function_stack() <= depth  # nothing new left (earlier ones may leave)


def test_user_modes_entered_around_the_forward_stay_balanced():
    depth = torch._C._len_torch_function_stack()
    model = _model()
    x, y = _data()
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        with torch.device("cpu"):  # a TorchFunctionMode entered before and left after the forward
            out = model(x)
        F.cross_entropy(out, y, reduction="sum").backward()
        assert hooks.grad_samples
        hooks.clear()
        assert torch._C._len_torch_function_stack() == depth  # the tracker left with the round
        with torch.device("cpu"):
            out = model(x)
        assert torch._C._len_torch_function_stack() == depth + 1  # following the loss, below the device mode
        F.cross_entropy(out, y, reduction="sum").backward()
    assert torch._C._len_torch_function_stack() <= depth  # nothing new left (earlier ones may leave)


def test_labels_the_model_never_sees_are_followed_into_the_loss():
    """``loss / (y != ignore).sum()``: the divisor comes from labels outside the model; the DP loader's
    batch is tagged when the forward starts, so the count is a total and the division is refused."""
    model, optimizer, loader = _private()
    xb, yb = next(iter(loader))
    per_sample = F.cross_entropy(model(xb), yb, reduction="none")
    with pytest.raises(PerSampleGradientError, match="couples"):
        (per_sample.sum() / (yb != 0).sum()).backward()  # divided by a count of the batch's labels
    F.cross_entropy(model(xb), yb, reduction="none").sum().backward()  # the same labels in a per-sample loss train


def test_a_refused_step_leaves_no_tracker_behind_for_the_next_engine():
    depth = torch._C._len_torch_function_stack()
    for _ in range(3):  # refused at backward, never detached, the engine dropped
        model = _model()
        x, y = _data()
        hooks = GradSampleHooks(model, loss_reduction="sum")
        with pytest.raises(PerSampleGradientError):
            _contrastive(model(x), y).backward()
        del hooks
    model = _model()
    x, y = _data()
    with GradSampleHooks(model, loss_reduction="sum") as hooks:  # a fresh controller trains, and tidies up
        F.cross_entropy(model(x), y, reduction="sum").backward()
        assert hooks.grad_samples
    assert torch._C._len_torch_function_stack() <= depth  # nothing new left (earlier ones may leave)


def test_a_forward_refused_inside_leaves_no_tracker_behind():
    depth = torch._C._len_torch_function_stack()

    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 3)

        def forward(self, x):
            return self.proj(x - x.mean(0))

    model = Centred()
    hooks = GradSampleHooks(model, loss_reduction="sum")
    with pytest.raises(PerSampleGradientError):
        model(torch.randn(N, 4))
    assert torch._C._len_torch_function_stack() <= depth  # nothing new left (earlier ones may leave)
    hooks.cleanup()


def test_a_total_returned_in_a_model_output_trains():
    from transformers.modeling_outputs import CausalLMOutput

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def forward(self, x, y):
            out = self.net(x)
            return CausalLMOutput(loss=F.cross_entropy(out, y, reduction="sum"), logits=out)

    model = WithLoss()
    x, y = _data()
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        out = model(x, y)
        assert out.loss.requires_grad and out.loss.grad_fn is not None  # property reads keep the total
        out.loss.backward()
        assert hooks.grad_samples
