"""capture_step: a captured private step gives the eager step's clipped sums bit for bit (padding rows, a tied
GPT-2 with its own positions, a non-finite unit), accounts every draw as the eager step does, traces once per
batch shape, traces again when something it could depend on changed, and refuses what it cannot prove: samples
that meet (in the model or in the loss before it), a failed value check, a batch not handed out last,
data-dependent Python, a forward that keeps state."""

import warnings

import pytest
import torch
import transformers
from torch import nn
from torch.utils.data import TensorDataset

from dptorch import PrivacyEngine
from dptorch.data import DPDataLoader, TruncatedPoissonDataLoader
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.optim import DPOptimizer
from dptorch.optim.captured_step import CaptureRefused, capture_step
from dptorch.plan import SamplingMismatchError
from tests.engine.test_compile_after_wrap import Mixing
from tests.engine.test_static_shape_batches import B, Q, dataset, network, private, resumed_after, run_steps


def truncated(seed=3, steps=4):
    return TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=seed, steps=steps)


def cross_entropy(model):
    return lambda x, y: nn.functional.cross_entropy(model(x), y, reduction="sum")


def run(loader, captured, model=None, loss_of=cross_entropy, **options):
    """Train over ``loader`` (eager or captured), return each step's gradients, the step and the engine."""
    settings = dict(noise_multiplier=0.0, max_grad_norm=0.1, accountant="pld")
    settings.update(options)
    engine = PrivacyEngine(accountant=settings.pop("accountant"))
    engine, model, optimizer, dp_loader = private(loader, engine, model, **settings)
    loss_fn = loss_of(model)
    step = capture_step(optimizer, loss_fn, compile=False) if captured else None
    grads = []
    for batch in dp_loader:
        optimizer.zero_grad()
        if captured:
            step(*batch)
        else:
            loss_fn(*batch).backward()
        optimizer.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads, step, engine, optimizer


def assert_same(eager, captured):
    assert len(eager) == len(captured)
    for a, b in zip(eager, captured):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_padded_batches_give_the_eager_gradients_bit_for_bit_from_one_trace(mode, clipping):
    eager, _, engine, _ = run(truncated(), False, grad_sample_mode=mode, clipping=clipping)
    engine.detach()
    captured, step, engine, _ = run(truncated(), True, grad_sample_mode=mode, clipping=clipping)
    engine.detach()
    assert_same(eager, captured)
    assert step.traces == 1 and len(captured) == 4


def tiny_gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)).train()


def test_a_tied_gpt2_with_its_own_positions_gives_the_eager_gradients():
    """GPT-2's ``(1, T)`` positions meet the batch as a shared tensor: its per-sample gradients are checked
    against their total by value, an output of the graph here."""
    ids = torch.randint(0, 40, (40, 6), generator=torch.Generator().manual_seed(0))

    def lm_loss(model):
        return lambda x: nn.functional.cross_entropy(model(input_ids=x).logits.transpose(1, 2), x, reduction="sum")

    def loader():
        return TruncatedPoissonDataLoader(TensorDataset(ids), sample_rate=0.1, max_batch_size=6, seed=1, steps=3)

    eager, _, engine, _ = run(loader(), False, tiny_gpt2(), lm_loss)
    engine.detach()
    captured, step, engine, _ = run(loader(), True, tiny_gpt2(), lm_loss)
    engine.detach()
    assert_same(eager, captured)
    assert step.traces == 1


def test_poisson_batches_trace_once_per_size_and_are_accounted_as_the_eager_ones():
    def loader():
        return DPDataLoader(dataset(), sample_rate=0.15, seed=5, steps=8)

    eager, _, eager_engine, _ = run(loader(), False, noise_multiplier=1.0, accountant="rdp")
    captured, step, engine, _ = run(loader(), True, noise_multiplier=1.0, accountant="rdp")
    assert len(captured) == len(eager) == 8
    assert engine.get_epsilon(1e-5) == eager_engine.get_epsilon(1e-5) > 0
    assert engine.accountant.history == eager_engine.accountant.history
    draws = [len(y) for _, y in DPDataLoader(dataset(), sample_rate=0.15, seed=5, steps=8)]
    assert step.traces == len({n for n in draws if n}) < len(draws)
    eager_engine.detach()
    engine.detach()


def test_an_empty_draw_adds_the_noise_alone():
    loader = DPDataLoader(dataset(), sample_rate=0.02, seed=next(
        s for s in range(1000) if not len(next(iter(DPDataLoader(dataset(), sample_rate=0.02, seed=s, steps=1)))[1])),
        steps=1)
    engine, model, optimizer, dp_loader = private(loader, PrivacyEngine(), noise_multiplier=1.0)
    step = capture_step(optimizer, cross_entropy(model), compile=False)
    x, y = next(iter(dp_loader))
    assert len(y) == 0 and float(step(x, y)) == 0.0
    optimizer.step()
    assert step.traces == 0 and all(p.grad.abs().sum() > 0 for p in model.parameters())
    assert len(engine.accountant) == 1
    engine.detach()


def test_a_non_finite_unit_is_dropped_as_in_the_eager_step():
    x, y = dataset().tensors
    x = x.clone()
    x[3, 0] = float("inf")

    def loader():
        return DPDataLoader(TensorDataset(x, y), sample_rate=0.5, seed=next(
            s for s in range(1000) if 3 in DPDataLoader(TensorDataset(x, y), sample_rate=0.5, seed=s,
                                                       steps=1).batch_sampler.draw()[1]), steps=1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager, _, engine, eager_optimizer = run(loader(), False, clipping_stats="raw")
        engine.detach()
        captured, step, engine, optimizer = run(loader(), True, clipping_stats="raw")
        engine.detach()
    assert_same(eager, captured)
    assert optimizer.last_clipping_stats["nonfinite_units"] == eager_optimizer.last_clipping_stats["nonfinite_units"] == 1
    assert step.traces == 2  # the unmasked graph found it, the masked one dropped it


def test_a_step_whose_samples_meet_is_refused_before_any_graph():
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"), Mixing())
    step = capture_step(optimizer, lambda x, y: model(nn.functional.pad(x, (0, 1))).pow(2).sum(), compile=False)
    with pytest.raises(PerSampleGradientError, match="mixes or merges its samples") as refused:
        step(*next(iter(dp_loader)))
    assert not isinstance(refused.value, CaptureRefused)  # the tracker's refusal, as eagerly: no eager fallback
    assert step.traces == 1 and not optimizer._summed
    engine.detach()


def test_the_loss_mixing_the_batch_before_the_model_is_refused():
    """What the loss function derives from the batch before the forward is followed as a loader's batch is."""
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"))
    step = capture_step(optimizer, lambda x, y: nn.functional.cross_entropy(model(x - x.mean(0)), y, reduction="sum"),
                        compile=False)
    with pytest.raises(PerSampleGradientError, match="mixes or merges its samples"):
        step(*next(iter(dp_loader)))
    engine.detach()


@pytest.mark.parametrize("rows_per_replay", [None, 2])
def test_a_failed_value_check_refuses_the_round_and_keeps_nothing(rows_per_replay):
    class Regularised(nn.Module):
        """A shared layer output reaching the loss without meeting the batch: no per-sample split of it."""

        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(5, 5), nn.Linear(5, 2)

        def forward(self, x):
            table = self.emb(torch.arange(5))
            return self.lin(x + table[0]), table

    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"), Regularised())

    def loss_fn(x, y):
        out, table = model(x)
        return nn.functional.cross_entropy(out, y, reduction="sum") + table.pow(2).sum()

    step = capture_step(optimizer, loss_fn, compile=False, rows_per_replay=rows_per_replay)
    with pytest.raises(PerSampleGradientError, match="emb is called on inputs that carry no batch dimension"):
        step(*next(iter(dp_loader)))
    assert step.traces == 1 and optimizer.accumulated_iterations == 0 and not optimizer._summed
    engine.detach()


def test_a_batch_other_than_the_latest_as_handed_out_is_refused():
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"))
    step = capture_step(optimizer, cross_entropy(model), compile=False)
    batches = iter(dp_loader)
    x, y = next(batches)
    for changed in ((x * 2, y), (x[:3], y[:3]), (x.flip(0), y), (x - x.mean(0), y)):
        with pytest.raises(PerSampleGradientError, match="latest batch as handed out"):
            step(*changed)
    step(x.clone(), y.to(torch.int64, copy=True))  # copies holding its values (moved to a device): the batch
    optimizer.zero_grad()
    next(batches)
    with pytest.raises(PerSampleGradientError, match="latest batch as handed out"):
        step(x, y)  # an earlier draw's
    assert step.traces == 1  # the copies' trace
    engine.detach()


@pytest.mark.parametrize("change", ["hook", "attribute", "parameter"])
def test_a_change_the_graph_could_depend_on_is_traced_again(change):
    def changed(model):
        if change == "hook":
            model[0].register_forward_hook(lambda module, args, out: out * 2)
        elif change == "attribute":
            model[1].negative_slope = 0.5
        else:
            model[2].weight = nn.Parameter(model[2].weight.detach() * 3)

    def network_changed_after_a_step():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 4), nn.LeakyReLU(0.01), nn.Linear(4, 2))

    results = []
    for captured in (False, True):
        model = network_changed_after_a_step()
        engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"), model,
                                                      noise_multiplier=0.0, max_grad_norm=0.1)
        step = capture_step(optimizer, cross_entropy(model), compile=False)
        grads = []
        for i, (x, y) in enumerate(dp_loader):
            if i == 2:
                changed(model)
                optimizer.original_optimizer.param_groups[0]["params"] = list(model.parameters())
            optimizer.zero_grad()
            step(x, y) if captured else cross_entropy(model)(x, y).backward()
            optimizer.step()
            grads.append([p.grad.clone() for p in model.parameters()])
        results.append(grads)
        engine.detach()
    assert_same(*results)
    assert step.traces == 2


def test_eval_mode_after_a_trace_is_refused():
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"))
    step = capture_step(optimizer, cross_entropy(model), compile=False)
    batches = iter(dp_loader)
    step(*next(batches))
    optimizer.step()
    model.eval()
    with pytest.raises(PerSampleGradientError, match="eval mode"):
        step(*next(batches))
    engine.detach()


def test_data_dependent_python_is_refused_naming_it():
    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 2)

        def forward(self, x):
            return self.lin(x) if x.sum() > 0 else -self.lin(x)

    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"), Branching())
    with pytest.raises(CaptureRefused, match="reads a tensor's value into Python"):  # the eager step may run it
        capture_step(optimizer, cross_entropy(model), compile=False)(*next(iter(dp_loader)))
    assert all(p.grad is None for p in model.parameters())
    engine.detach()


def test_a_forward_that_keeps_state_on_its_module_is_refused_and_put_back():
    class Caching(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 2)
            self.last = torch.zeros(())

        def forward(self, x):
            self.last = x.detach().sum()
            return self.lin(x)

    model = Caching()
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"), model)
    before = model.last
    with pytest.raises(PerSampleGradientError, match=r"changed Caching\.last"):
        capture_step(optimizer, cross_entropy(model), compile=False)(*next(iter(dp_loader)))
    assert model.last is before
    engine.detach()


@pytest.mark.parametrize("options", [dict(grad_sample_mode="ew"), dict(clipping="per_layer", max_grad_norm=[0.1] * 4)])
def test_settings_a_captured_round_does_not_reproduce_are_refused(options):
    engine, model, optimizer, _ = private(truncated(), PrivacyEngine(accountant="pld"), **options)
    with pytest.raises(PerSampleGradientError, match="capture_step does not support"):
        capture_step(optimizer, cross_entropy(model))
    engine.detach()


def test_a_compiled_captured_step_trains_as_the_eager_one():
    """torch.compile of the graph: the parameters read by reference after each in-place update."""
    eager, _, engine, _ = run(truncated(steps=3), False)
    engine.detach()
    settings = dict(noise_multiplier=0.0, max_grad_norm=0.1)
    engine, model, optimizer, dp_loader = private(truncated(steps=3), PrivacyEngine(accountant="pld"), **settings)
    step = capture_step(optimizer, cross_entropy(model))
    compiled = []
    for x, y in dp_loader:
        optimizer.zero_grad()
        step(x, y)
        optimizer.step()
        compiled.append([p.grad.clone() for p in model.parameters()])
    engine.detach()
    assert step.traces == 1 and len(compiled) == 3
    for a, b in zip(eager, compiled):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_a_new_clipping_bound_applies_from_the_next_step_without_a_new_trace():
    def bounds_changed(captured):
        engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"),
                                                      noise_multiplier=0.0, max_grad_norm=0.1)
        step = capture_step(optimizer, cross_entropy(model), compile=False)
        grads = []
        for i, (x, y) in enumerate(dp_loader):
            optimizer.max_grad_norm = [0.1, 0.02, 5.0, 0.3][i]
            optimizer.zero_grad()
            step(x, y) if captured else cross_entropy(model)(x, y).backward()
            optimizer.step()
            grads.append([p.grad.clone() for p in model.parameters()])
        engine.detach()
        return grads, step.traces

    (eager, _), (captured, traces) = bounds_changed(False), bounds_changed(True)
    assert_same(eager, captured)
    assert traces == 1


def test_a_draw_stepped_twice_is_refused_at_the_optimizer_step():
    """Two captured rounds on one draw would hold each sample twice: the plan's ledger counts the rows."""
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"))
    step = capture_step(optimizer, cross_entropy(model), compile=False)
    x, y = next(iter(dp_loader))
    step(x, y)
    step(x, y)
    with pytest.raises(SamplingMismatchError):
        optimizer.step()
    engine.detach()


def test_a_gradient_by_a_path_the_controller_does_not_see_is_refused_at_the_trace():
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"))
    step = capture_step(optimizer, lambda x, y: cross_entropy(model)(x, y) + model[0].weight.pow(2).sum(),
                        compile=False)
    with pytest.raises(PerSampleGradientError, match="0.weight"):
        step(*next(iter(dp_loader)))
    assert all(p.grad is None for p in model.parameters())
    engine.detach()


def test_secure_mode_draws_and_noises_a_captured_run():
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, steps=2, secure_mode=True)
    engine, model, optimizer, dp_loader = private(loader, PrivacyEngine(accountant="pld", secure_mode=True),
                                                  noise_multiplier=1.0)
    step = capture_step(optimizer, cross_entropy(model), compile=False)
    for x, y in dp_loader:
        optimizer.zero_grad()
        step(x, y)
        optimizer.step()
    assert type(optimizer.noise_generator).__name__ == "SecureNoiseGenerator" and len(engine.accountant) == 2
    engine.detach()


def test_an_operation_run_with_torch_functions_off_on_the_batch_is_refused_at_the_trace():
    """The unseen-operation guard watches the trace's ATen operations as it watches an eager step's."""
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"))

    def loss_fn(x, y):
        with torch._C.DisableTorchFunction():
            mean = x.mean(0)
        return cross_entropy(model)(x - mean, y)

    with pytest.raises(PerSampleGradientError, match="torch functions switched off"):
        capture_step(optimizer, loss_fn, compile=False)(*next(iter(dp_loader)))
    engine.detach()


def test_poisson_batches_padded_to_a_multiple_trace_once_per_multiple_and_train_as_the_eager_ones():
    def loader():
        return DPDataLoader(dataset(), sample_rate=0.25, seed=2, steps=10)

    settings = dict(noise_multiplier=0.0, max_grad_norm=0.1)
    engine, model, optimizer, dp_loader = private(loader(), PrivacyEngine(accountant="rdp"), **settings)
    step = capture_step(optimizer, cross_entropy(model), compile=False, pad_to_multiple_of=4)
    captured = []
    for x, y in dp_loader:
        optimizer.zero_grad()
        step(x, y)
        optimizer.step()
        captured.append([p.grad.clone() for p in model.parameters()])
    sizes = [len(y) for _, y in loader()]
    assert step.traces == len({-(-n // 4) for n in sizes if n}) < len({n for n in sizes if n})
    assert len(captured) == len(sizes) == 10  # and each step's ledger saw its draw's real rows (else step() raises)
    engine.detach()
    eager, _, engine, _ = run(loader(), False, accountant="rdp")
    engine.detach()
    for a, b in zip(eager, captured):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_one_loss_per_row_is_reduced_and_reported_over_the_real_rows(reduction):
    """A loss function that returns one loss per row: the step differentiates their reduction (the gradients are the
    scalar loss's, bit for bit) and returns it over the real rows alone when it pads (pad_to_multiple_of)."""
    def per_row(model):
        return lambda x, y: nn.functional.cross_entropy(model(x), y, reduction="none")

    def reduced(model):
        return lambda x, y: getattr(per_row(model)(x, y), reduction)()

    def steps(loss_of, pad):
        engine, model, optimizer, dp_loader = private(
            DPDataLoader(dataset(), sample_rate=0.25, seed=2, steps=4), PrivacyEngine(accountant="rdp"),
            noise_multiplier=0.0, max_grad_norm=0.1, loss_reduction=reduction)
        step = capture_step(optimizer, loss_of(model), compile=False, pad_to_multiple_of=pad)
        losses, grads = [], []
        for x, y in dp_loader:
            optimizer.zero_grad()
            expected = reduced(model)(x, y).detach() if len(y) else None
            losses.append((step(x, y), expected))
            optimizer.step()
            grads.append([p.grad.clone() for p in model.parameters()])
        engine.detach()
        return losses, grads

    scalar, rows = steps(reduced, None), steps(per_row, None)
    assert_same(scalar[1], rows[1])
    assert [loss for loss, _ in scalar[0]] == [loss for loss, _ in rows[0]]
    padded_losses, padded_grads = steps(per_row, 8)
    assert any(len(y) % 8 for _, y in DPDataLoader(dataset(), sample_rate=0.25, seed=2, steps=4))  # rows were padded
    for loss, expected in padded_losses:
        if expected is not None:
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(rows[1], padded_grads):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_poisson_batches_in_replays_of_a_fixed_width_trace_once_and_train_as_the_eager_ones(reduction):
    """rows_per_replay=m: each batch runs as replays of exactly m rows (the last padded), one graph for every size;
    the pieces' clipped sums add up to the eager round, every draw is accounted, the loss is the real rows'."""
    def loader():
        return DPDataLoader(dataset(), sample_rate=0.4, seed=4, steps=8)

    def per_row(model):
        return lambda x, y: nn.functional.cross_entropy(model(x), y, reduction="none")

    sizes = [len(y) for _, y in loader()]
    assert max(sizes) > 6 and len({n for n in sizes if n}) > 2  # several pieces a batch, several sizes
    settings = dict(noise_multiplier=1.0, max_grad_norm=0.1, loss_reduction=reduction, accountant="rdp")
    eager, _, eager_engine, _ = run(loader(), False, loss_of=lambda m: lambda x, y: getattr(per_row(m)(x, y), reduction)(),
                                    **settings)
    engine, model, optimizer, dp_loader = private(loader(), PrivacyEngine(accountant="rdp"),
                                                  **{k: v for k, v in settings.items() if k != "accountant"})
    step = capture_step(optimizer, per_row(model), compile=False, rows_per_replay=3)
    captured, losses = [], []
    for x, y in dp_loader:
        optimizer.zero_grad()
        expected = getattr(per_row(model)(x, y), reduction)().detach() if len(y) else None
        losses.append((step(x, y), expected))
        optimizer.step()
        captured.append([p.grad.clone() for p in model.parameters()])
    assert step.traces == 1 and len(captured) == len(eager) == 8
    assert engine.accountant.history == eager_engine.accountant.history
    for a, b in zip(eager, captured):
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    for loss, expected in losses:
        if expected is not None:
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    eager_engine.detach()
    engine.detach()


def test_a_padded_draw_in_replays_with_pieces_of_padding_alone():
    """A truncated Poisson draw (padding rows at its end) in replays of 2 rows: pieces holding padding alone are not
    replayed, add exactly nothing and leave the reported mean loss the real rows'; the ledger is told the draw's
    rows, the clipping statistics count the real rows."""
    seed = next(s for s in range(1000) if 0 < len(truncated(seed=s, steps=1).batch_sampler.draw()[1]) <= B - 4)
    settings = dict(noise_multiplier=0.0, max_grad_norm=0.1, loss_reduction="mean", clipping_stats="raw")
    mean = lambda m: lambda x, y: nn.functional.cross_entropy(m(x), y)  # noqa: E731
    eager, _, engine, eager_optimizer = run(truncated(seed=seed, steps=1), False, loss_of=mean, **settings)
    engine.detach()
    engine, model, optimizer, dp_loader = private(truncated(seed=seed, steps=1), PrivacyEngine(accountant="pld"),
                                                  **settings)
    step = capture_step(optimizer, lambda x, y: nn.functional.cross_entropy(model(x), y, reduction="none"),
                        compile=False, rows_per_replay=2)
    x, y = next(iter(dp_loader))
    real = len(truncated(seed=seed, steps=1).batch_sampler.draw()[1])
    optimizer.zero_grad()
    loss = step(x, y)
    torch.testing.assert_close(loss, nn.functional.cross_entropy(model(x[:real]), y[:real]).detach())
    optimizer.step()
    for u, v in zip(eager[0], [p.grad for p in model.parameters()]):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-7)
    assert step.traces == 1  # and the ledger took the draw's rows (optimizer.step() refuses a round it was not told)
    assert step.replays == -(-real // 2) < B // 2  # the pieces with a real row
    stats, eager_stats = optimizer.last_clipping_stats, eager_optimizer.last_clipping_stats
    assert stats.keys() == eager_stats.keys()  # the norms to rounding: each piece's mean is over its own 2 rows
    assert {k: v for k, v in stats.items() if k != "norm_quantiles"} == {
        k: v for k, v in eager_stats.items() if k != "norm_quantiles"}
    assert stats["norm_quantiles"] == pytest.approx(eager_stats["norm_quantiles"], rel=1e-6)
    engine.detach()


@pytest.mark.parametrize("options", [dict(rows_per_replay=0), dict(rows_per_replay=True), dict(pad_to_multiple_of=-1),
                                     dict(rows_per_replay=4, pad_to_multiple_of=4)])
def test_row_options_out_of_range_or_together_are_refused(options):
    engine, model, optimizer, _ = private(truncated(), PrivacyEngine(accountant="pld"))
    with pytest.raises(ValueError, match="pad_to_multiple_of|rows_per_replay"):
        capture_step(optimizer, cross_entropy(model), compile=False, **options)
    engine.detach()


def test_a_loss_of_another_shape_is_refused_naming_the_contract():
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"), noise_multiplier=0.0,
                                                  max_grad_norm=0.1)
    step = capture_step(optimizer, lambda x, y: model(x), compile=False)
    with pytest.raises(TypeError, match=rf"a scalar tensor, or one loss per row, shape \({B},\); got \({B}, 2\)"):
        step(*next(iter(dp_loader)))
    engine.detach()


def test_a_200_step_run_of_fixed_shape_batches_traces_and_compiles_once():
    from torch._dynamo.utils import counters  # noqa: PLC0415 - Dynamo's own record of what it compiled

    torch._dynamo.reset()
    counters.clear()
    loader = TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=3, steps=200)
    engine, model, optimizer, dp_loader = private(loader, PrivacyEngine(accountant="pld"), noise_multiplier=1.0)
    step = capture_step(optimizer, cross_entropy(model))
    for x, y in dp_loader:
        optimizer.zero_grad()
        step(x, y)
        optimizer.step()
    assert step.traces == 1 and counters["stats"]["unique_graphs"] == 1 and len(engine.accountant) == 200
    engine.detach()


def test_a_200_step_poisson_run_in_replays_of_a_fixed_width_traces_and_compiles_once():
    from torch._dynamo.utils import counters  # noqa: PLC0415 - Dynamo's own record of what it compiled

    torch._dynamo.reset()
    counters.clear()
    loader = DPDataLoader(dataset(), sample_rate=Q, seed=3, steps=200)
    sizes = {len(y) for _, y in DPDataLoader(dataset(), sample_rate=Q, seed=3, steps=200)}
    engine, model, optimizer, dp_loader = private(loader, PrivacyEngine(accountant="rdp"), noise_multiplier=1.0)
    step = capture_step(optimizer, cross_entropy(model), rows_per_replay=4)
    for x, y in dp_loader:
        optimizer.zero_grad()
        step(x, y)
        optimizer.step()
    assert len(sizes) > 8 and max(sizes) > 8  # Poisson sizes, most of them more than one replay
    assert step.traces == 1 and counters["stats"]["unique_graphs"] == 1 and len(engine.accountant) == 200
    engine.detach()


def test_adaptive_clipping_moves_the_bound_as_in_the_eager_run():
    """The noised count of unclipped units is drawn by optimizer.step(), from the captured round's norms."""
    runs = []
    for captured in (False, True):
        grads, _, engine, optimizer = run(truncated(steps=4), captured, noise_multiplier=1.0, clipping="adaptive",
                                          target_unclipped_quantile=0.5, unclipped_num_std=1.0)
        runs.append((grads, float(optimizer.max_grad_norm), optimizer.last_unclipped_fraction))
        engine.detach()
    (eager, eager_bound, eager_fraction), (captured, bound, fraction) = runs
    assert bound == eager_bound != 0.1 and fraction == eager_fraction
    assert_same(eager, captured)


def test_the_graph_replays_with_no_mode_on_torch_stacks(monkeypatch):
    """Dynamo never runs under the tracker: the draw's watch and the unseen-operation guard step aside."""
    from torch.overrides import _get_current_function_mode_stack  # noqa: PLC0415 - torch's mode stack, read here only

    from dptorch.optim import captured_step  # noqa: PLC0415 - the round's constructor, patched below

    stacks = []
    made = captured_step.CapturedRound.__init__

    def recorded(self, *args):
        stacks.append((len(_get_current_function_mode_stack()), torch._C._len_torch_dispatch_stack()))
        made(self, *args)

    monkeypatch.setattr(captured_step.CapturedRound, "__init__", recorded)
    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"))
    step = capture_step(optimizer, cross_entropy(model), compile=False)
    for x, y in dp_loader:
        assert len(_get_current_function_mode_stack()) == 1  # the draw's watch, before the step
        step(x, y)
        optimizer.step()
    assert stacks == [(0, 0)] * 4
    engine.detach()


def test_a_write_through_an_alias_that_mixes_the_batch_is_refused_at_the_trace():
    """Fake tensors have no memory address: the tracker knows aliases of batch memory by their storage object
    (found by the sensitivity fuzzer: before, this step trained on the mixed rows)."""

    class WritesThroughAnAlias(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 4), nn.Linear(4, 2)

        def forward(self, x):
            z = self.a(x) * 1.0
            z.detach().sub_(z.detach().mean(0))
            return self.b(z)

    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"), WritesThroughAnAlias())
    with pytest.raises(PerSampleGradientError, match="mixes or merges its samples"):
        capture_step(optimizer, cross_entropy(model), compile=False)(*next(iter(dp_loader)))
    engine.detach()


def test_a_resumed_captured_run_continues_the_accounting_and_the_steps_of_the_eager_run_exactly(tmp_path):
    """The captured step holds no state of its own: after a checkpoint a new one continues the run, and five
    captured steps with a resume between them are the five eager steps (draws, noise, parameters, epsilon)."""
    def start():
        torch.manual_seed(5)
        return private(TruncatedPoissonDataLoader(dataset(), sample_rate=Q, max_batch_size=B, seed=9),
                       PrivacyEngine(accountant="pld"))

    def captured_train():
        """``train_step`` through one captured step per optimizer (a resumed run makes a new one)."""
        steps = {}

        def train(model, optimizer, x, y):
            if optimizer not in steps:
                steps[optimizer] = capture_step(optimizer, cross_entropy(model), compile=False)
            optimizer.zero_grad()
            steps[optimizer](x, y)
            optimizer.step()

        return train

    straight = start()
    run_steps(*straight, 5)
    train = captured_train()
    resumed = resumed_after(tmp_path, start, 2, train)
    run_steps(*resumed, 3, train)
    assert resumed[0].plan.steps == 5 and resumed[0].get_epsilon(1e-5) == straight[0].get_epsilon(1e-5)
    for p, q in zip(resumed[1].parameters(), straight[1].parameters()):
        assert torch.equal(p, q)
    resumed[0].detach(), straight[0].detach()


def test_a_graph_the_compiler_fails_on_is_refused_naming_the_way_out():
    def failing(graph, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    engine, model, optimizer, dp_loader = private(truncated(), PrivacyEngine(accountant="pld"), noise_multiplier=0.0,
                                                  max_grad_norm=0.1)
    step = capture_step(optimizer, cross_entropy(model), compile={"backend": failing})
    with pytest.raises(CaptureRefused, match="torch.compile failed on the traced step.*compile=False"):
        step(*next(iter(dp_loader)))
    assert not step._graphs  # nothing kept: the next call traces afresh
    engine.detach()


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused(mode):
    engine, model, optimizer, _ = private(truncated(), PrivacyEngine(accountant="pld"))
    with pytest.raises(ValueError, match="CUDA graphs"):
        capture_step(optimizer, cross_entropy(model), compile={"mode": mode})
    engine.detach()


def test_a_gpt2_whose_trace_compares_row_orders_compiles_as_one_graph():
    """The tracker compares the row orders it keeps (``torch.equal`` on the trace's constants) for GPT-2's tied head
    at this width: those calls leave the graph, which Dynamo then takes whole (it broke the graph at each)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=256, n_head=4, vocab_size=5000, n_positions=128, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        bos_token_id=0, eos_token_id=0)).train()
    ids = torch.randint(0, 5000, (4, 128), generator=torch.Generator().manual_seed(0))
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    hooks = GradSampleHooks(model, grad_sample_mode="bk", keep_param_grads=False)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=4)
    loss_of = lambda i, p: nn.functional.cross_entropy(  # noqa: E731
        model(input_ids=i, position_ids=p).logits.transpose(1, 2), i, reduction="none").mean()
    step = capture_step(optimizer, loss_of, compile={"backend": counting})
    torch._dynamo.reset()
    step(ids, torch.arange(128).expand(4, 128).contiguous())
    assert len(graphs) == 1
    hooks.cleanup()
