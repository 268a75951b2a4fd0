"""DPRNN, DPGRU, DPLSTM: equivalence with torch's layers, state_dict both ways, per-sample oracle."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

from dptorch.grad_sample import GradSampleHooks
from dptorch.layers import DPGRU, DPLSTM, DPRNN
from tests.helpers import check_per_sample_grads

PAIRS = {"lstm": (nn.LSTM, DPLSTM), "gru": (nn.GRU, DPGRU), "rnn": (nn.RNN, DPRNN)}
B, T, IN, H = 3, 5, 4, 6


def make_pair(kind: str, dtype=torch.float64, **config):
    """A torch layer and a DP layer holding the same weights."""
    torch_type, dp_type = PAIRS[kind]
    reference = torch_type(IN, H, dtype=dtype, **config)
    dp = dp_type(IN, H, dtype=dtype, **config)
    dp.load_state_dict(reference.state_dict())
    return reference, dp


def initial_state(kind: str, config: dict, batch: int = B, dtype=torch.float64):
    count = config.get("num_layers", 1) * (2 if config.get("bidirectional") else 1)
    h0 = torch.randn(count, batch, config.get("proj_size") or H, dtype=dtype)
    return (h0, torch.randn(count, batch, H, dtype=dtype)) if kind == "lstm" else h0


def assert_same(a, b):
    if isinstance(a, PackedSequence):
        assert isinstance(b, PackedSequence)
        for x, y in zip(a, b):
            if x is None:
                assert y is None
            else:
                torch.testing.assert_close(x, y)
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        torch.testing.assert_close(a, b)


CONFIGS = [
    dict(),
    dict(num_layers=2, bidirectional=True),
    dict(num_layers=3, bias=False, batch_first=True),
    dict(bidirectional=True, batch_first=True),
]
LSTM_CONFIGS = [dict(proj_size=2), dict(proj_size=3, num_layers=2, bidirectional=True, batch_first=True)]
ALL_CASES = [(k, c) for k in PAIRS for c in CONFIGS] + [("lstm", c) for c in LSTM_CONFIGS] + [("rnn", dict(nonlinearity="relu", num_layers=2))]


@pytest.mark.parametrize("kind,config", ALL_CASES)
def test_outputs_and_gradients_equal_torch(kind, config):
    torch.manual_seed(0)
    reference, dp = make_pair(kind, **config)
    x = torch.randn((B, T, IN) if config.get("batch_first") else (T, B, IN), dtype=torch.float64)
    for hx in (None, initial_state(kind, config)):
        expected, got = reference(x, hx), dp(x, hx)
        assert_same(expected, got)
    out_expected, out_got = reference(x), dp(x)
    out_expected[0].pow(2).sum().backward()
    out_got[0].pow(2).sum().backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(getattr(dp, name).grad, param.grad, msg=name)


@pytest.mark.parametrize("kind,config", [("lstm", dict(num_layers=2, bidirectional=True, proj_size=2)), ("gru", dict(batch_first=True)), ("rnn", {})])
def test_unbatched_input(kind, config):
    reference, dp = make_pair(kind, **config)
    x = torch.randn(T, IN, dtype=torch.float64)
    assert_same(reference(x), dp(x))
    hx = initial_state(kind, config, batch=1)
    hx = tuple(h[:, 0] for h in hx) if kind == "lstm" else hx[:, 0]
    assert_same(reference(x, hx), dp(x, hx))


@pytest.mark.parametrize("kind,config", [("lstm", dict(num_layers=2, bidirectional=True)), ("lstm", dict(proj_size=3, batch_first=True)), ("gru", dict(bidirectional=True)), ("rnn", dict(num_layers=2))])
@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_packed_sequences_equal_torch(kind, config, enforce_sorted):
    torch.manual_seed(1)
    reference, dp = make_pair(kind, **config)
    lengths = [5, 4, 2, 2] if enforce_sorted else [2, 5, 1, 4]
    packed = pack_sequence([torch.randn(n, IN, dtype=torch.float64) for n in lengths], enforce_sorted=enforce_sorted)
    for hx in (None, initial_state(kind, config, batch=len(lengths))):
        assert_same(reference(packed, hx), dp(packed, hx))


@pytest.mark.parametrize("kind,config", ALL_CASES)
def test_state_dict_loads_both_ways(kind, config):
    torch_type, dp_type = PAIRS[kind]
    reference, dp = torch_type(IN, H, **config), dp_type(IN, H, **config)
    assert list(dp.state_dict()) == list(reference.state_dict())
    dp.load_state_dict(reference.state_dict(), strict=True)
    fresh = torch_type(IN, H, **config)
    fresh.load_state_dict(dp.state_dict(), strict=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(dp.state_dict()[name], value)
        torch.testing.assert_close(fresh.state_dict()[name], value)
    assert {n: p.shape for n, p in reference.named_parameters()} == {n: getattr(dp, n).shape for n, _ in reference.named_parameters()}


def test_state_dict_names_inside_a_model_and_after_deepcopy():
    class Model(nn.Module):
        def __init__(self, rnn):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(IN, IN))
            self.rnn = rnn

    reference = Model(nn.LSTM(IN, H, num_layers=2, bidirectional=True))
    dp = Model(DPLSTM(IN, H, num_layers=2, bidirectional=True))
    assert list(dp.state_dict()) == list(reference.state_dict())
    dp.load_state_dict(reference.state_dict())
    clone = copy.deepcopy(dp)
    reference.rnn.weight_hh_l1_reverse.data.add_(1.0)
    clone.load_state_dict(reference.state_dict())  # the hooks of the copy act on the copy
    torch.testing.assert_close(clone.rnn.weight_hh_l1_reverse, reference.rnn.weight_hh_l1_reverse)
    assert not torch.equal(dp.rnn.weight_hh_l1_reverse, reference.rnn.weight_hh_l1_reverse)
    buffer = io.BytesIO()
    torch.save(clone.rnn, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert list(loaded.state_dict()) == list(reference.rnn.state_dict())
    loaded.load_state_dict(reference.rnn.state_dict())


def test_torch_names_are_attributes():
    dp = DPLSTM(IN, H, num_layers=2, bidirectional=True, proj_size=2)
    assert dp.weight_ih_l0 is dp.sweeps["l0"].weight_ih
    assert dp.weight_hr_l1_reverse is dp.sweeps["l1_reverse"].weight_hr
    replacement = nn.Parameter(torch.zeros_like(dp.weight_hh_l0))
    dp.weight_hh_l0 = replacement
    assert dp.sweeps["l0"].weight_hh is replacement and "weight_hh_l0" not in dp._parameters
    assert [len(w) for w in dp.all_weights] == [5] * 4
    dp.flatten_parameters()
    with pytest.raises(AttributeError):
        dp.weight_ih_l2


def test_dropout_between_layers_only_in_training():
    reference, dp = make_pair("gru", num_layers=2, dropout=0.5)
    x = torch.randn(T, B, IN, dtype=torch.float64)
    reference.eval(), dp.eval()
    assert_same(reference(x), dp(x))
    dp.train()
    assert not torch.allclose(dp(x)[0], reference(x)[0])


def test_argument_errors():
    with pytest.raises(ValueError, match="proj_size"):
        DPLSTM(IN, H, proj_size=H)
    with pytest.raises(ValueError, match="nonlinearity"):
        DPRNN(IN, H, nonlinearity="gelu")
    with pytest.raises(ValueError, match="dropout"):
        DPGRU(IN, H, dropout=1.5)
    with pytest.raises(RuntimeError, match="input_size"):
        DPGRU(IN, H)(torch.randn(T, B, IN + 1))
    with pytest.raises(RuntimeError, match="hidden size"):
        DPGRU(IN, H)(torch.randn(T, B, IN), torch.randn(1, B + 1, H))
    with pytest.raises(RuntimeError, match="sequence length"):
        DPGRU(IN, H)(torch.randn(0, B, IN))


# ---------------------------------------------------------------------------------- per-sample


class BatchFirstStates(nn.Module):
    """Takes initial states batch-first (so the harness can split them) and returns per-sample tensors."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, h0, c0=None):
        hx = h0.transpose(0, 1).contiguous()
        if c0 is not None:
            hx = (hx, c0.transpose(0, 1).contiguous())
        output, hidden = self.rnn(x, hx)
        h_n = hidden[0] if isinstance(hidden, tuple) else hidden
        finals = torch.cat([h.transpose(0, 1).flatten(1) for h in (hidden if isinstance(hidden, tuple) else (hidden,))], 1)
        return output, finals, h_n


def rnn_loss(outputs):
    """Per-sample loss over the output sequence and every final state."""
    output, finals = outputs[0], outputs[1]
    g = torch.Generator().manual_seed(7)
    w_out = torch.randn(output.shape[1:], generator=g, dtype=output.dtype)
    w_fin = torch.randn(finals.shape[1:], generator=g, dtype=finals.dtype)
    return (output * w_out).flatten(1).sum(1) + (finals * w_fin).sum(1)


ORACLE_CASES = [
    ("lstm", dict(num_layers=2, bidirectional=True)),
    ("lstm", dict(proj_size=3, num_layers=2, bidirectional=True)),
    ("lstm", dict(bias=False)),
    ("gru", dict(num_layers=2, bidirectional=True)),
    ("rnn", dict(nonlinearity="relu", bidirectional=True)),
    ("rnn", dict(num_layers=2)),
]


@pytest.mark.parametrize("kind,config", ORACLE_CASES)
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_per_sample_gradients_match_oracle(kind, config, loss_reduction):
    torch.manual_seed(2)
    dp = PAIRS[kind][1](IN, H, batch_first=True, **config)
    model = BatchFirstStates(dp)
    hx = initial_state(kind, config, dtype=torch.float32)
    states = tuple(h.transpose(0, 1).contiguous() for h in (hx if kind == "lstm" else (hx,)))
    check_per_sample_grads(model, (torch.randn(B, T, IN), *states), loss_fn=rnn_loss, loss_reduction=loss_reduction)


def test_per_sample_gradients_without_initial_state_and_frozen_weights():
    dp = DPLSTM(IN, H, batch_first=True, num_layers=2)
    dp.weight_hh_l0.requires_grad_(False)
    dp.bias_ih_l1.requires_grad_(False)
    check_per_sample_grads(dp, (torch.randn(B, T, IN),), loss_fn=lambda out: rnn_loss((out[0], out[1][1].transpose(0, 1).flatten(1))))


def test_time_major_layer_inside_a_batch_first_model():
    """A batch_first=False layer gets (T, B, F) from its model; its calls to the controller stay batch-first."""

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(11, IN)
            self.lstm = DPLSTM(IN, H, num_layers=2, bidirectional=True)
            self.head = nn.Linear(2 * H, 3)

        def forward(self, tokens):  # tokens: (B, T)
            output, _ = self.lstm(self.embedding(tokens).transpose(0, 1))
            return self.head(output.transpose(0, 1))

    check_per_sample_grads(Tagger(), (torch.randint(0, 11, (B, T)),))


@pytest.mark.parametrize("kind,config", [("lstm", dict(num_layers=2, bidirectional=True, proj_size=2)), ("gru", dict(bidirectional=True)), ("rnn", {})])
def test_per_sample_gradients_with_packed_sequences(kind, config):
    """Each sequence of a PackedSequence gets the gradient it would get packed alone."""
    torch.manual_seed(3)
    dp = PAIRS[kind][1](IN, H, **config)
    sequences = [torch.randn(n, IN) for n in (2, 5, 1, 4)]
    g = torch.Generator().manual_seed(5)
    width = (2 if config.get("bidirectional") else 1) * (config.get("proj_size") or H)
    w_out, w_fin = torch.randn(T, width, generator=g), torch.randn(H, generator=g)

    def losses(packed_output):
        output, hidden = packed_output
        padded, _ = pad_packed_sequence(output, batch_first=True)
        h_n = hidden[1] if isinstance(hidden, tuple) else hidden  # c_n for an LSTM
        return (padded * w_out[: padded.shape[1]]).flatten(1).sum(1) + (h_n * w_fin).sum((0, 2))

    params = [p for p in dp.parameters()]
    expected = {p: [] for p in params}
    for sequence in sequences:
        dp.zero_grad(set_to_none=True)
        losses(dp(pack_sequence([sequence]))).sum().backward()
        for p in params:
            expected[p].append(p.grad.clone())
    dp.zero_grad(set_to_none=True)
    with GradSampleHooks(dp, loss_reduction="sum") as hooks:
        losses(dp(pack_sequence(sequences, enforce_sorted=False))).sum().backward()
        for p in params:
            torch.testing.assert_close(hooks.grad_samples[p], torch.stack(expected[p]), rtol=1e-4, atol=1e-5)


def test_dropout_per_sample_gradients_sum_to_the_gradient():
    torch.manual_seed(4)
    dp = DPGRU(IN, H, num_layers=3, dropout=0.3, batch_first=True)
    with GradSampleHooks(dp, loss_reduction="sum") as hooks:
        dp(torch.randn(B, T, IN))[0].pow(2).sum().backward()
        for p in dp.parameters():
            torch.testing.assert_close(hooks.grad_samples[p].sum(0), p.grad, rtol=1e-4, atol=1e-5)


def test_every_sweep_is_one_hooked_call_per_layer_direction():
    dp = DPLSTM(IN, H, num_layers=2, bidirectional=True, batch_first=True)
    calls = []
    handles = [m.register_forward_hook(lambda m, a, o: calls.append(tuple(o.shape))) for m in dp.sweeps.values()]
    dp(torch.randn(B, T, IN))
    for handle in handles:
        handle.remove()
    assert calls == [(B, T, 2 * H)] * 4


def test_empty_batch():
    dp = DPLSTM(IN, H, batch_first=True, bidirectional=True, proj_size=2)
    with GradSampleHooks(dp, loss_reduction="sum") as hooks:
        output, (h_n, c_n) = dp(torch.randn(0, T, IN))
        assert output.shape == (0, T, 4) and h_n.shape == (2, 0, 2) and c_n.shape == (2, 0, H)
        output.sum().backward()
        assert all(hooks.grad_samples[p].shape == (0, *p.shape) for p in dp.parameters())


def test_controller_with_time_major_batches_is_exact():
    """The sweeps' calls are batch-first inside a time-major layer; the controller follows the batch
    from the root's dim 1 to the sweeps' dim 0 (here T == B, where sizes cannot tell)."""
    torch.manual_seed(3)
    check_per_sample_grads(DPGRU(IN, H), (torch.randn(B, B, IN),), batch_first=False)
