"""A clipped sum is certified for its own sample's roundings, whatever order a kernel sums in.

The norm a clip factor is formed from covers the rounding of the clipped sum over the sample's own tokens
(``certified``: ``gamma_m M``, ``m`` about ``T``). A record whose two tokens' output gradients cancel
(``K w`` and ``-K w``) has a tiny norm and so a huge factor: if a kernel adds other samples' terms while
one of its scaled ``c K w`` is in the accumulator (one matmul over all ``B T`` rows, summed in blocks of
the kernel's choosing; ``index_add`` with atomics on a GPU), each of those additions is rounded at the
scale ``c K``, and the record moves the update by far more than C. So every clipped sum adds each
sample's tokens on their own first (``linear_forms.token_sums``, ``embedding.SampleRows``), and only
finished per-sample sums meet.

``AdversarialOrder`` plays such a kernel: float32 products, ``index_add`` and sums are accumulated one term
at a time, the two largest terms first and last, the rest shuffled between (any order is a legal one).
Under it, the crafted record must move the noiseless update by at most C, in every bk path that sums
tokens: Linear weight and bias, Conv1D, two layers reading one input, an embedding, a layer called twice,
a tied embedding and head; and the clipped sum of packed token units and of an expert bank
must stay within its rounding of the exact one.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.pytorch_utils import Conv1D

from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.layers.experts import ExpertFactors, experts_kept_clipped_sum
from dptorch.grad_sample.norms import linear_forms, shared_inputs
from dptorch.grad_sample.norms.certified import gamma
from dptorch.grad_sample.norms.linear_forms import token_sums
from dptorch.grad_sample.norms.shared_inputs import AffineUse
from dptorch.grad_sample.units.packed_affine import PackedLayout, packed_affine_clipped_sums
from dptorch.grad_sample.units.token_units import TokenUnits
from dptorch.optim import DPOptimizer

aten = torch.ops.aten
C = 1.0
K = 2.0**30
#: Samples beside the record: the adversary adds all their terms between its two tokens.
BATCH = 2000


class AdversarialOrder(TorchDispatchMode):
    """Float32 ``mm``/``addmm``/``bmm``/``baddbmm``, ``index_add`` and ``sum`` over dims, each accumulated one
    term at a time in the order ``_order`` (every product and addition rounded to float32, as a kernel's)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def _order(self, terms: torch.Tensor) -> list:
        """The largest term first, the second largest last, the rest shuffled between: a cancelling pair is
        kept apart by every other term."""
        by_size = torch.argsort(terms.flatten(1).abs().amax(1), descending=True, stable=True).tolist()
        if len(by_size) < 3:
            return by_size
        rest = by_size[2:]
        return [by_size[0]] + [rest[i] for i in torch.randperm(len(rest), generator=self.generator).tolist()] + [by_size[1]]

    def _accumulate(self, start: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
        acc = start.clone()
        for k in self._order(terms):
            acc = acc + terms[k]
        return acc

    def _matmul(self, start: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        terms = a.transpose(-1, -2).unsqueeze(-1) * b.unsqueeze(-2)  # (..., K, M, N): one product a term
        return self._accumulate(start, terms.movedim(-3, 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        floats = [t for t in args if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats or any(t.dtype != torch.float32 for t in floats) or any(k in kwargs for k in ("beta", "alpha")):
            return func(*args, **kwargs)
        if func in (aten.mm.default, aten.bmm.default):
            a, b = args
            return self._matmul(a.new_zeros(*a.shape[:-1], b.shape[-1]), a, b)
        if func in (aten.addmm.default, aten.baddbmm.default):
            start, a, b = args
            return self._matmul(start.expand(*a.shape[:-1], b.shape[-1]), a, b)
        if func in (aten.index_add.default, aten.index_add_.default) and args[1] == 0:
            out, _, index, source = args
            acc = out.clone()
            for i in self._order(source):
                acc[index[i]] = acc[index[i]] + source[i]
            return out.copy_(acc) if func is aten.index_add_.default else acc
        if func is aten.sum.dim_IntList and kwargs.get("dtype") is None:
            x, dims = args[0], [d % args[0].dim() for d in args[1]]
            keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            moved = x.movedim(dims, list(range(len(dims)))).flatten(0, len(dims) - 1) if dims else x.unsqueeze(0)
            out = self._accumulate(moved.new_zeros(moved.shape[1:]), moved)
            for d in sorted(dims) if keep else ():
                out = out.unsqueeze(d)
            return out
        return func(*args, **kwargs)


def noiseless_update(model: nn.Module, inputs, grads, adversarial: bool) -> dict:
    """One bk step at noise 0, every clipped sum formed under ``AdversarialOrder`` (or the kernels' own order)."""
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.zeros_(p)
    hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode="bk")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=C, expected_batch_size=inputs.shape[0], loss_reduction="sum")
    if adversarial:
        original = hooks.clipped_sums

        def shuffled(*args, **kwargs):
            with AdversarialOrder():
                return original(*args, **kwargs)

        hooks.clipped_sums = shuffled
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # noise 0 is not private
            (model(inputs) * grads).sum().backward()
            optimizer.step()
    finally:
        hooks.cleanup()
    return {name: p.detach().double().clone() for name, p in model.named_parameters()}


def moved(model_fn, inputs, grads, record_inputs, record_grads, position: int, adversarial: bool = True) -> float:
    """The norm of the update's change when the record joins the batch at ``position`` (the update is minus
    the clipped sum at learning rate 1)."""
    def at(x, r):
        return torch.cat([x[:position], r[None], x[position:]])
    with_record = noiseless_update(model_fn(), at(inputs, record_inputs), at(grads, record_grads), adversarial)
    without = noiseless_update(model_fn(), inputs, grads, adversarial)
    return float(sum((with_record[k] - without[k]).pow(2).sum() for k in without).sqrt())


@pytest.fixture(autouse=True, params=["blocks", "one_by_one"])
def ghost_everywhere(monkeypatch, request):
    """Ghost norms for every weight of more than one token (bk's choice where instantiating costs memory);
    the clipped sums' samples in blocks (these small layers' default) or one at a time (a large layer's)."""
    monkeypatch.setattr(shared_inputs, "INSTANTIATED_MEMORY", 0)
    if request.param == "one_by_one":
        monkeypatch.setattr(linear_forms, "SUM_BLOCK", 1)


def unit(g: torch.Generator, n: int) -> torch.Tensor:
    v = torch.randn(n, generator=g)
    return v / v.norm()


def others_and_record(batch: int, tokens: int, width: int, g: torch.Generator):
    """Random samples, and a record of ``tokens`` tokens whose first and last output gradients are ``K w``, ``-K w``."""
    grads = torch.randn(batch, tokens, width, generator=g)
    record = torch.zeros(tokens, width)
    w = unit(g, width)
    record[0], record[-1] = K * w, -K * w
    return grads, record


class SharedInput(nn.Module):
    """Two linear layers reading one input (q and k): their clipped sums are formed together (``shared_inputs``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d, d // 2), nn.Linear(d, d // 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x)], dim=-1)


def bias_only(d: int) -> nn.Linear:
    layer = nn.Linear(d, d)
    layer.weight.requires_grad_(False)
    return layer


AFFINE = {
    "linear": lambda d: nn.Linear(d, d, bias=False),
    "bias_only": bias_only,
    "linear_with_bias": lambda d: nn.Linear(d, d),
    "hf_conv1d": lambda d: Conv1D(d, d),
    "shared_input": SharedInput,
}


@pytest.mark.parametrize("name", list(AFFINE))
def test_affine_record_moves_the_update_by_at_most_C(name):
    g = torch.Generator().manual_seed(1)
    batch, tokens, d = BATCH, 2, 8
    inputs = torch.randn(batch, tokens, d, generator=g)
    grads, record_grads = others_and_record(batch, tokens, d, g)
    u = unit(g, d)
    record_inputs = torch.stack([u] * tokens)
    distance = moved(lambda: AFFINE[name](d), inputs, grads, record_inputs, record_grads, batch // 2)
    assert distance <= C * (1 + 1e-5), distance


def test_embedding_record_moves_the_update_by_at_most_C():
    """Ids from a vocabulary of 3: every row's sum holds many samples' tokens beside the record's."""
    g = torch.Generator().manual_seed(2)
    batch, tokens, d = BATCH, 2, 8
    ids = torch.randint(0, 3, (batch, tokens), generator=g)
    grads, record_grads = others_and_record(batch, tokens, d, g)
    record_ids = torch.tensor([1] * tokens)
    distance = moved(lambda: nn.Embedding(3, d), ids, grads, record_ids, record_grads, batch // 2)
    assert distance <= C * (1 + 1e-5), distance


class TwoCalls(nn.Module):
    """One linear layer called twice on one input: its weight's two uses can cancel each other."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.layer = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.layer(x), self.layer(x)], dim=-1)


class Tied(nn.Module):
    """An embedding and a head sharing one weight; the input packs each token's id (column 0) and the head's
    input (the rest), the output the embedding's and the head's outputs side by side."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.emb(x[..., 0].long()), self.head(x[..., 1:])], dim=-1)


def test_a_weights_two_uses_that_cancel_move_the_update_by_at_most_C():
    """Each use's clipped sum holds the record's big half while the other samples' are added to it."""
    g = torch.Generator().manual_seed(5)
    batch, tokens, d = BATCH, 2, 8
    inputs = torch.randn(batch, tokens, d, generator=g)
    grads = torch.randn(batch, tokens, 2 * d, generator=g)
    w, u = unit(g, d), unit(g, d)
    record_inputs, record_grads = torch.zeros(tokens, d), torch.zeros(tokens, 2 * d)
    record_inputs[0] = u
    record_grads[0, :d], record_grads[0, d:] = K * w, -K * w
    distance = moved(lambda: TwoCalls(d), inputs, grads, record_inputs, record_grads, batch // 2)
    assert distance <= C * (1 + 1e-5), distance


def test_a_tied_embedding_and_head_that_cancel_move_the_update_by_at_most_C():
    g = torch.Generator().manual_seed(6)
    batch, tokens, d, vocab = BATCH, 2, 8, 3
    inputs = torch.cat([torch.randint(0, vocab, (batch, tokens, 1), generator=g).float(),
                        torch.randn(batch, tokens, d, generator=g)], dim=-1)
    grads = torch.randn(batch, tokens, d + vocab, generator=g)
    w = unit(g, d)
    record_inputs, record_grads = torch.zeros(tokens, 1 + d), torch.zeros(tokens, d + vocab)
    record_inputs[:, 0] = 1.0  # the row both uses reach
    record_inputs[0, 1:] = w
    record_grads[0, :d] = K * w  # the embedding adds K w to row 1
    record_grads[0, d + 1] = -K  # the head adds -K w to it
    distance = moved(lambda: Tied(vocab, d), inputs, grads, record_inputs, record_grads, batch // 2)
    assert distance <= C * (1 + 1e-5), distance


def test_the_adversary_finds_the_leak_of_one_matmul_over_the_batch():
    """The check can fail: the old clipped sum (one matmul over all ``B T`` rows) under the same order moves
    the update by many times C."""
    g = torch.Generator().manual_seed(1)
    batch, tokens, d = BATCH, 2, 8
    a = torch.randn(batch, tokens, d, generator=g)
    b, record_b = others_and_record(batch, tokens, d, g)
    a = torch.cat([a, torch.stack([unit(g, d)] * tokens)[None]])
    b = torch.cat([b, record_b[None]])
    factors = torch.ones(batch + 1)
    factors[-1] = C / (gamma(tokens + 4, torch.float32) * 2 * K)  # what the record's certified norm gives
    scaled = b * factors.view(-1, 1, 1)
    with AdversarialOrder():
        one_matmul = scaled.reshape(-1, d).t() @ a.reshape(-1, d)
        per_sample = token_sums(scaled, a)
    exact = torch.einsum("btp,btd->pd", scaled.double(), a.double())
    assert float((one_matmul.double() - exact).norm()) > 1.5 * C
    assert float((per_sample.double() - exact).norm()) <= 1e-3 * C


def crafted_rows(units: int, tokens: int, d: int, g: torch.Generator):
    """``(units, tokens, d)`` inputs and output gradients, unit 0 the crafted record, and each unit's clip factor:
    1 for the others, the record's the size its certified norm gives (``gamma_{T+4}`` of its magnitude ``2K``)."""
    a, b = torch.randn(units, tokens, d, generator=g), torch.randn(units, tokens, d, generator=g)
    b[0], a[0] = others_and_record(0, tokens, d, g)[1], 0.0
    a[0, 0] = a[0, -1] = unit(g, d)
    factors = torch.ones(units)
    factors[0] = C / (gamma(tokens + 4, torch.float32) * 2 * K)
    return a, b, factors


def exact_sum(a: torch.Tensor, b: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    return torch.einsum("u,utp,utd->pd", factors.double(), b.double(), a.double())


def test_packed_units_sum_each_units_tokens_first():
    """Packed rows of two units of 10 tokens each (``packed_affine``): the record's unit moves the clipped sum by
    its own rounding only."""
    g = torch.Generator().manual_seed(3)
    rows, tokens, d = BATCH // 10, 10, 8
    a, b, factors = crafted_rows(2 * rows, tokens, d, g)
    ids = torch.arange(2 * rows).repeat_interleave(tokens).view(rows, 2 * tokens)
    layout = PackedLayout(TokenUnits(ids))
    weight = nn.Parameter(torch.zeros(d, d))
    use = AffineUse(a.reshape(rows, 2 * tokens, d), b.reshape(rows, 2 * tokens, d), weight, None)
    with AdversarialOrder():
        (summed,) = packed_affine_clipped_sums([use], [(factors, None)], [None], layout)
    assert float((summed[weight].double() - exact_sum(a, b, factors)).norm()) <= 0.05 * C


def test_expert_bank_sums_each_samples_pairs_first():
    """An expert's pairs (``experts._summed``): the record's two pairs cancel in ``du``."""
    g = torch.Generator().manual_seed(4)
    batch, pairs, d = BATCH, 2, 8
    x, du, factors = crafted_rows(batch, pairs, d, g)
    bank = nn.Module()
    bank.gate_up_proj = nn.Parameter(torch.zeros(1, d, d))
    bank.down_proj = nn.Parameter(torch.zeros(1, d, d), requires_grad=False)
    rows = torch.arange(batch).repeat_interleave(pairs)
    ranks = torch.arange(pairs).repeat(batch)
    held = ExpertFactors(0, x.reshape(-1, d), du.reshape(-1, d), du.reshape(-1, d), x.reshape(-1, d), rows, ranks, batch, pairs)
    with AdversarialOrder():
        summed = experts_kept_clipped_sum(bank, {"factors": [held], "dtype": torch.float32}, factors)
    assert float((summed[bank.gate_up_proj][0].double() - exact_sum(x, du, factors)).norm()) <= 0.05 * C
