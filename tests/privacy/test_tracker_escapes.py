"""Ways around the batch tracker, through the path users take (make_private with its DP loader).

Each case is a step the one-step oracle (``step_oracle.verdict``) judges against the float64
batch-of-one reference: where the computation mixes the samples, refusing is the only way to pass.
The cases are the "Privacy soundness, round three" findings: a second model input that is a copy of
the batch, in-place writes of a batch total through an alias, tensors made where ``__torch_function__``
does not see (the legacy constructor, DLPack), the batch size or a copy of the labels read into the
loss. Each failed on the code before it (an update that moved by up to 6 C).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptorch.data import drawn
from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError
from dptorch.grad_sample.tracking import watch
from tests.privacy.step_oracle import verdict

N, D = 6, 3
MODES = ["hooks", "bk", "functorch"]


class TwoInputs(nn.Module):
    def __init__(self, mix):
        super().__init__()
        self.lin, self.mix = nn.Linear(D, 2), mix

    def forward(self, x, c):
        return self.lin(self.mix(x, c))


class OneInput(nn.Module):
    def __init__(self, mix=lambda z: z):
        super().__init__()
        self.lin, self.mix = nn.Linear(D, 2), mix

    def forward(self, x):
        return self.lin(self.mix(x))


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g) * 5, torch.randint(0, D, (N,), generator=g)


def _judge(model, loss_fn, mode):
    torch.manual_seed(0)
    return verdict(model, _batch(0), loss_fn, mode, 1.0, replacement=_batch(1))


def _refused(found):
    assert found["outcome"] == "refused", found


MIXES = {
    "mean": lambda x, c: x - c.mean(0),
    "sum": lambda x, c: x + c.sum(0),
    "cumsum": lambda x, c: x + c.cumsum(0),
    "roll": lambda x, c: x + c.roll(1, 0),
    "flip": lambda x, c: x + c.flip(0),
}
COPIES = {
    "x * 1": lambda x, y: x * 1,
    "clone": lambda x, y: x.clone(),
    "one_hot": lambda x, y: F.one_hot(y, D).float(),
    "to": lambda x, y: x.to(torch.float32, copy=True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("copy", list(COPIES))
@pytest.mark.parametrize("mix", list(MIXES))
def test_a_copy_of_the_batch_as_a_second_input_is_not_mixed(mix, copy, mode):
    make = COPIES[copy]
    _refused(_judge(TwoInputs(MIXES[mix]), lambda m, x, y: m(x, make(x, y)).sum(), mode))


@pytest.mark.parametrize("mix", list(MIXES))
def test_without_a_dp_loader_a_second_input_with_n_rows_is_not_mixed(mix):
    """No draw to follow: a root argument with n rows may be the samples' data (a weak tag), and it is
    refused where it is mixed over its rows."""
    model = TwoInputs(MIXES[mix])
    x = torch.randn(N, D)
    with GradSampleHooks(model):
        with pytest.raises(PerSampleGradientError, match="as many rows as the batch"):
            model(x, x.clone())


def test_mixing_the_batch_before_the_forward_is_refused():
    """The draw's watch follows the batch from the loader to the forward: ``model(x - x.mean(0))``."""
    for mode in MODES:
        _refused(_judge(OneInput(), lambda m, x, y: m(x - x.mean(0)).sum(), mode))


@pytest.mark.parametrize("mode", MODES)
def test_copies_of_the_batch_made_before_the_forward_train_exactly(mode):
    """What the watch sees derived from the draw without mixing is batched: exact, not refused."""
    found = _judge(TwoInputs(lambda x, c: x * c), lambda m, x, y: m(x.clone(), F.one_hot(y, D).float()).sum(), mode)
    assert found["outcome"] == "exact", found


WRITES = {
    "detach().sub_": lambda z: z.detach().sub_(z.detach().mean(0)),
    "data.sub_": lambda z: z.data.sub_(z.data.mean(0)),
    "[:].add_": lambda z: z[:].add_(z.sum(0)),
    "view().add_": lambda z: z.view(-1, D).add_(z.mean(0)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("write", list(WRITES))
def test_a_batch_total_written_in_place_through_an_alias_is_refused(write, mode):
    def mix(z):
        WRITES[write](z)
        return z

    _refused(_judge(OneInput(mix), lambda m, x, y: m(x * 1).sum(), mode))


BYPASSES = {
    "torch.Tensor": lambda t: torch.Tensor(t),
    "from_dlpack": lambda t: torch.from_dlpack(t),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bypass", list(BYPASSES))
def test_an_alias_made_outside_torch_function_keeps_the_batch(bypass, mode):
    """The tag follows the memory: a batch total seen through an untracked constructor is refused, and the
    batch itself seen that way is still the batch (exact)."""
    make = BYPASSES[bypass]
    _refused(_judge(OneInput(lambda z: z - make(z.mean(0).detach())), lambda m, x, y: m(x).sum(), mode))
    found = _judge(OneInput(lambda z: make(z.detach()) * z), lambda m, x, y: m(x).sum(), mode)
    assert found["outcome"] == "exact", found


SCALINGS = {
    "sum / len(y)": lambda out, x, y: out.sum() / len(y),
    "sum / x.shape[0]": lambda out, x, y: out.sum() / x.shape[0],
    "l1 / x.size(0)": lambda out, x, y: F.l1_loss(out, torch.zeros_like(out), reduction="sum") / x.size(0),
    "per-sample / len(y), summed": lambda out, x, y: (out / len(y)).sum(),
    "sum * tensor(1 / n)": lambda out, x, y: out.sum() * torch.tensor(1.0 / x.shape[0]),
    "count of a labels copy": lambda out, x, y: (lambda yc: F.cross_entropy(out, yc % 2, reduction="sum")
                                                 / (yc != -100).sum())(y.clone()),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_a_loss_divided_by_the_batch_size_is_refused(scaling, mode):
    scale = SCALINGS[scaling]
    _refused(_judge(OneInput(), lambda m, x, y: scale(m(x), x, y), mode))


def test_a_size_read_before_the_draw_is_followed():
    """``len(y)`` read before the forward (the draw's watch) counts as much as one read after it."""
    def loss(m, x, y):
        n = len(y)
        return m(x).sum() / n

    _refused(_judge(OneInput(), loss, "hooks"))


SHIFTS = {
    "item of the mean": lambda out: out - out.mean().item(),
    "float of a sample's value": lambda out: out - float(out[0, 0]),
    "tolist": lambda out: out + out[:, 0].tolist()[-1],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shift", list(SHIFTS))
def test_a_loss_shifted_by_a_value_read_from_the_batch_is_refused(shift, mode):
    """``(out - out.mean().item())**2``: the number is a statistic of the batch (a centred loss couples every
    sample's gradient to the others'); before, only scalings by a read number were refused."""
    move = SHIFTS[shift]
    _refused(_judge(OneInput(), lambda m, x, y: move(m(x)).pow(2).sum(), mode))


@pytest.mark.parametrize("mode", MODES)
def test_a_constant_scaling_without_a_read_trains_exactly(mode):
    """A loss scaled by a constant, with shapes read only where they are not the batch size, is private."""
    found = _judge(OneInput(), lambda m, x, y: (lambda out: out.view(-1, out.size(-1)).sum() * 0.5)(m(x)), mode)
    assert found["outcome"] == "exact", found


def test_the_watch_leaves_the_mode_stack_when_the_controllers_detach():
    model = OneInput()
    watch.stop()  # an earlier test's draw, watched while some controller of it was still attached
    depth = torch._C._len_torch_function_stack()
    hooks = GradSampleHooks(model)
    drawn.hand_out([torch.randn(N, D)])
    assert torch._C._len_torch_function_stack() == depth + 1
    hooks.cleanup()
    assert torch._C._len_torch_function_stack() == depth and not watch._WATCH


class FirstTokenEverywhere(nn.Module):
    """Packed rows: each token gets the row's first token, through the legacy constructor."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, input_ids, position_ids=None):
        h = self.embed(input_ids)
        return self.head(h + torch.Tensor(h[:, :1].detach()))


def test_an_untracked_alias_does_not_carry_one_packed_example_into_another():
    from tests.grad_sample.test_token_units import UNIT_IDS_KEY, VOCAB, PackingCollator, examples

    packed = PackingCollator(pad_token_id=0, max_length=8)(examples([5, 3, 4, 2]))
    model = FirstTokenEverywhere(VOCAB).train()
    for mode in ("hooks", "bk"):
        hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
        hooks.set_privacy_units(packed[UNIT_IDS_KEY])
        try:
            with pytest.raises(PerSampleGradientError, match="token positions do not each hold"):
                model(packed["input_ids"])
        finally:
            hooks.cleanup()


def _micro_batched_step(mode, cut):
    """One noiseless step of make_private over the draw, one forward and backward per micro-batch."""
    from torch.utils.data import TensorDataset

    from dptorch import PrivacyEngine
    from dptorch.data import DPDataLoader

    torch.manual_seed(0)
    model = OneInput()
    engine = PrivacyEngine()
    loader = DPDataLoader(TensorDataset(*_batch(0)), sample_rate=1.0, steps=1)
    _, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum", grad_sample_mode=mode, wrap_model=False)
    try:
        for x, y in loader:
            for rows in cut:
                F.cross_entropy(model(x[rows]), y[rows] % 2, reduction="sum").backward()
            optimizer.step()
    finally:
        engine.detach()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_cut_from_the_draw_train_exactly_and_misaligned_rows_are_refused(mode):
    """Micro-batches cut from the draw, each with its labels cut the same way, give the step of the whole
    draw; a micro-batch beside other samples' labels, or the draw's rows reordered beside the labels in
    theirs, pairs one sample's output with another's label: refused."""
    half = N // 2
    whole = _micro_batched_step(mode, [slice(None)])
    for got, want in zip(_micro_batched_step(mode, [slice(0, half), slice(half, None)]), whole):
        torch.testing.assert_close(got, want)
    ce = lambda out, y: F.cross_entropy(out, y % 2, reduction="sum")  # noqa: E731
    _refused(_judge(OneInput(), lambda m, x, y: ce(m(x[:half]), y[half:]), mode))
    _refused(_judge(OneInput(), lambda m, x, y: ce(m(x[:half]), y[:half].flip(0)), mode))
    _refused(_judge(OneInput(), lambda m, x, y: ce(m(x.flip(0)), y), mode))
    _refused(_judge(OneInput(), lambda m, x, y: ce(m(x[torch.tensor([1, 0, 2, 3, 4, 5])]), y), mode))


class LossInside(nn.Module):
    """An HF-style model that returns its own summed loss, divided inside the forward by ``divide(x)``."""

    def __init__(self, divide):
        super().__init__()
        self.lin, self.divide = nn.Linear(D, 2), divide

    def forward(self, x):
        return self.lin(x).pow(2).sum() / self.divide(x)


@pytest.mark.parametrize("mode", MODES)
def test_a_total_scaled_inside_the_forward_is_refused_at_backward(mode):
    """Inside the forward shapes are read all the time, so a number scaling the total there may be the batch
    size: refused, whatever the number (a constant too: scale outside the forward)."""
    _refused(_judge(LossInside(lambda x: x.shape[0]), lambda m, x, y: m(x), mode))
    _refused(_judge(LossInside(lambda x: 2.0), lambda m, x, y: m(x), mode))
    found = _judge(LossInside(lambda x: 1), lambda m, x, y: m(x) / 2.0, mode)
    assert found["outcome"] == "refused" and "inside the model's forward" in found["message"], found
    assert _judge(OneInput(), lambda m, x, y: m(x).pow(2).sum() / 2.0, mode)["outcome"] == "exact"


@pytest.mark.parametrize("show", [repr, str, lambda t: f"{t.mean():.6f}"])
def test_a_tensor_made_a_string_inside_the_forward_is_refused(show):
    """A string carries the values out of torch as well as ``.item()`` (and back, parsed): refused in the forward."""
    def mix(z):
        text = show(z.mean())
        return z - float(text.split("(")[-1].split(",")[0].rstrip(")")) if "(" in text else z - float(text)

    _refused(_judge(OneInput(mix), lambda m, x, y: m(x).sum(), "hooks"))


def _private_loop(loader):
    from dptorch import PrivacyEngine

    model = OneInput()
    engine = PrivacyEngine()
    _, optimizer, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                               data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                               loss_reduction="sum", wrap_model=False)
    return engine, model, optimizer, loader


def test_the_watch_ends_with_the_loaders_pass():
    """After the last batch of a pass nothing of the draw is followed (no mode stays on torch's stack)."""
    from torch.utils.data import TensorDataset

    from dptorch.data import DPDataLoader

    watch.stop()
    depth = torch._C._len_torch_function_stack()
    engine, model, optimizer, loader = _private_loop(DPDataLoader(TensorDataset(*_batch(0)), sample_rate=0.5, steps=2))
    for x, y in loader:
        model(x).sum().backward()
        optimizer.step()
    assert torch._C._len_torch_function_stack() == depth and not watch._WATCH
    engine.detach()


def test_the_watch_ends_when_the_loop_leaves_the_loader_early():
    """A loop left by ``break`` drops the loader's iterator after a forward and backward of the draw: the
    watch ends there, not at the next hand-out (a mode left on torch's stack slows every later operation)."""
    from torch.utils.data import TensorDataset

    from dptorch.data import DPDataLoader

    watch.stop()
    depth = torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()
    engine, model, optimizer, loader = _private_loop(DPDataLoader(TensorDataset(*_batch(0)), sample_rate=0.9, steps=5))
    for step, (x, y) in enumerate(loader):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert watch._WATCH  # still following the loop while it iterates
        if step == 1:
            break
    assert (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()) == depth  # and the guard
    assert not watch._WATCH
    engine.detach()


def test_a_batch_taken_by_next_iter_is_watched_until_its_step():
    """``next(iter(loader))`` drops the iterator before the batch is trained on: the watch stays through the
    draw's micro-batches (each forward still sees the whole way from the draw) and ends at the step."""
    from torch.utils.data import TensorDataset

    from dptorch.data import DPDataLoader

    watch.stop()
    depth = torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()
    engine, model, optimizer, loader = _private_loop(DPDataLoader(TensorDataset(*_batch(0)), sample_rate=1.0, steps=3))
    x, y = next(iter(loader))
    assert watch._WATCH
    for part in (x[: N // 2], x[N // 2:]):
        model(part.clone()).sum().backward()  # a copy cut from the draw: the watch tells the forward so
        assert watch._WATCH
    optimizer.step()
    assert (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()) == depth  # and the guard
    assert not watch._WATCH
    engine.detach()


def test_the_watch_ends_when_a_loop_over_the_memory_manager_breaks():
    from torch.utils.data import TensorDataset

    from dptorch.data import DPDataLoader
    from dptorch.data.memory_manager import BatchMemoryManager

    watch.stop()
    depth = torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()
    engine, model, optimizer, loader = _private_loop(DPDataLoader(TensorDataset(*_batch(0)), sample_rate=1.0, steps=3))
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as physical:
        for x, y in physical:
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            break
    assert (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()) == depth  # and the guard
    assert not watch._WATCH
    engine.detach()
