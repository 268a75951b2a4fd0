"""The DP guarantee, tested where it lives: the noiseless clipped sum of one step.

For a zoo of small models (the shapes that broke privacy before: T5's relative attention bias,
nanoGPT's ``wpe(arange(T))``, a time-major encoder, a tied head read directly, subclassed
layers, bf16 weights) and every mode, with batch sizes and sequence lengths drawn by
hypothesis (``T == n`` included):

- where the model is supported, the clipped sum ``sum_i c_i g_i`` equals the one built from the
  batch-of-one reference gradients, and replacing one sample moves it by at most ``2 C``;
- where it is not, the controller refuses it (attach or backward), never a silent answer.

Then a fuzzer: random compositions of row-wise and mixing torch operations around trainable layers
and in the loss (``compositions.py``), each step run through ``make_private`` and judged by one
oracle (``step_oracle.py``): refused before any parameter changes, or exact against the float64
batch-of-one reference with replace-one <= 2C and add/remove <= C. The issue's measured leaks are
its examples and explicit tests, with HF GPT-2's built-in loss and the labels-given positive case.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch import DPLoss, ModuleValidator
from dptorch.grad_sample import GradSampleHooks
from dptorch.clipping.factors import clip_factors, flat_norms
from tests.helpers import call, projection_loss, reference_per_sample_grads, sample_of
from tests.privacy import compositions as comp
from tests.privacy import step_oracle as oracle

C = 0.5
MODES = ["hooks", "bk", "ghost", "functorch", "ew"]
REFUSED, EW_REFUSED = oracle.REFUSED, oracle.EW_REFUSED


# ---------------------------------------------------------------------------------- the zoo


def tiny_t5():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0)
    return T5EncoderModel(config)


class NanoGPT(nn.Module):
    """nanoGPT's embedding pattern: positions from ``torch.arange(t)``, no batch dimension."""

    def __init__(self, vocab=30, d=12, block=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        q, k, v = self.attn(self.ln(x)).chunk(3, dim=-1)
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        att = (q @ k.transpose(-2, -1) / 4).masked_fill(~mask, float("-inf")).softmax(-1)
        return self.head(x + att @ v)


def time_major_encoder():
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=False)
    return ModuleValidator.fix(layer)


class TiedHeadReadDirectly(nn.Module):
    def __init__(self, vocab=13, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)

    def forward(self, ids):
        return torch.tanh(self.mix(self.emb(ids))) @ self.emb.weight.T


class ScaledLinear(nn.Linear):
    """A subclass that overrides forward: the parent's sampler would be wrong for it."""

    def forward(self, x):
        return 3.0 * super().forward(x) + 0.5 * super().forward(x.flip(-1))


def subclassed_mlp():
    return nn.Sequential(ScaledLinear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def bf16_mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.bfloat16)


@dataclass
class Case:
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int, torch.Generator], tuple]
    refused_in: tuple = ()  # modes that must refuse the model
    batch_first: bool = True
    rtol: float = 1e-4


def token_ids(vocab):
    return lambda n, t, g: (torch.randint(0, vocab, (n, t), generator=g),)


ZOO = {
    "t5": Case(tiny_t5, token_ids(40), refused_in=("ew",)),
    "nanogpt": Case(NanoGPT, token_ids(30), refused_in=("ew",)),
    "time_major": Case(time_major_encoder, lambda n, t, g: (torch.randn(t, n, 8, generator=g),),
                       refused_in=("ew",), batch_first=False),
    "tied_head_read_directly": Case(TiedHeadReadDirectly, token_ids(13), refused_in=tuple(MODES)),
    "subclassed_layer": Case(subclassed_mlp, lambda n, t, g: (torch.randn(n, t, 6, generator=g),)),
    "bf16": Case(bf16_mlp, lambda n, t, g: (torch.randn(n, t, 6, generator=g).to(torch.bfloat16),), rtol=3e-2),
}


# ---------------------------------------------------------------------------------- one step


def clipped_sum(model: nn.Module, inputs: tuple, mode: str, batch_first: bool) -> dict:
    """``sum_i c_i g_i`` (float32) through the controller, as the DP optimizer forms it."""
    batch_dim = 0 if batch_first else 1
    hooks = GradSampleHooks(model, batch_first=batch_first, loss_reduction="sum", grad_sample_mode=mode,
                            keep_param_grads=False)
    try:
        output = call(model, inputs)
        if mode == "ghost":
            loss = DPLoss(lambda out: projection_loss(out, batch_dim), hooks)(output)
        else:
            loss = projection_loss(output, batch_dim).sum()
        loss.backward()
        norms = hooks.per_sample_norms()
        factor = clip_factors(flat_norms(norms), C)
        return {p: s.double() for p, s in hooks.clipped_sums({p: factor for p in norms}).items()}
    finally:
        hooks.cleanup()
        model.zero_grad(set_to_none=True)


def reference_clipped_sum(model: nn.Module, inputs: tuple, batch_first: bool) -> dict:
    batch_dim = 0 if batch_first else 1
    grads = reference_per_sample_grads(model, inputs, lambda out: projection_loss(out, batch_dim), batch_dim=batch_dim)
    grads = {p: g.double() for p, g in grads.items()}
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    factor = (C / (norms + 1e-6)).clamp(max=1.0)
    return {p: torch.einsum("i,i...->...", factor, g) for p, g in grads.items()}


def replace_one(inputs: tuple, n: int, batch_dim: int, g: torch.Generator, fresh: tuple) -> tuple:
    """The batch with its sample 0 replaced by sample 0 of ``fresh``."""
    out = []
    for t, f in zip(inputs, fresh):
        t = t.clone()
        t.narrow(batch_dim, 0, 1).copy_(f.narrow(batch_dim, 0, 1))
        out.append(t)
    return tuple(out)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(ZOO))
@settings(max_examples=4, deadline=None, derandomize=True)
@given(n=st.integers(1, 4), t=st.integers(1, 4))
@example(n=3, t=3)
@example(n=2, t=2)
def test_clipped_sum_matches_batch_of_one_and_moves_at_most_2C(name, mode, n, t):
    case = ZOO[name]
    torch.manual_seed(0)
    model = case.build()
    g = torch.Generator().manual_seed(n * 10 + t)
    inputs = case.inputs(n, t, g)
    batch_dim = 0 if case.batch_first else 1
    if mode in case.refused_in:
        with pytest.raises(EW_REFUSED if mode == "ew" else REFUSED):
            clipped_sum(model, inputs, mode, case.batch_first)
        return
    got = clipped_sum(model, inputs, mode, case.batch_first)
    want = reference_clipped_sum(model, inputs, case.batch_first)
    assert set(got) == set(want)
    scale = max(float(v.abs().max()) for v in want.values())
    for p in want:
        torch.testing.assert_close(got[p], want[p], rtol=case.rtol, atol=case.rtol * scale)
    neighbour = replace_one(inputs, n, batch_dim, g, case.inputs(n, t, g))
    moved = oracle.distance(got, clipped_sum(model, neighbour, mode, case.batch_first))
    assert moved <= 2 * C * (1 + 1e-5)


# ---------------------------------------------------------------------------------- the fuzzer
#
# Random compositions of torch operations around trainable layers and in the loss
# (tests/privacy/compositions.py), each step run as a user runs it and judged by one oracle for
# every composition (tests/privacy/step_oracle.py): refused before any parameter changes, or the
# noiseless clipped sum equals the float64 batch-of-one reference for the batch and its
# neighbours, replace-one move <= 2C and add/remove <= C.
#
# DPTORCH_FUZZ_RECORD=<file.jsonl> records every verdict instead of asserting
# (``python -m tests.privacy.fuzz_report OUT.md`` writes the list of failing compositions).

FUZZ_EXAMPLES = int(os.environ.get("DPTORCH_FUZZ_EXAMPLES", "40"))
RECORD = os.environ.get("DPTORCH_FUZZ_RECORD")


def judge(c: comp.Composition, mode: str, compile_model=None, captured: bool = False) -> dict:
    """The oracle's verdict on composition ``c`` in ``mode``, with the composition named (``compile_model``:
    the model compiled after the controller attached; ``captured``: a captured step; ``step_oracle.private_step``)."""
    start = time.perf_counter()
    found = oracle.verdict(comp.build(c), comp.data(c), lambda m, *b: comp.loss_of(m, c, *b), mode, c.clip,
                           replacement=comp.data(c, seed_offset=1), compile_model=compile_model, captured=captured)
    return {"composition": str(c), "mixing": c.mixing, **found, "seconds": time.perf_counter() - start}


def assert_oracle(found: dict, expected: Optional[str] = None) -> None:
    """No problems (and the ``expected`` outcome, where one is required); with
    DPTORCH_FUZZ_RECORD set, record the verdict (the unmet requirement as a problem) instead."""
    if expected is not None and found["outcome"] != expected:
        found = {**found, "problems": found["problems"] + [f"{found['outcome']}, expected {expected}: "
                                                           f"{found.get('message', '')[:200]}"]}
    if RECORD:
        with open(RECORD, "a") as f:
            f.write(json.dumps(found) + "\n")
        return
    assert not found["problems"], f"{found.get('composition', '')} [{found['mode']}]: " + "; ".join(found["problems"])


@st.composite
def compositions(draw) -> comp.Composition:
    """1-3 layers, up to 3 operations (row-wise or mixing, equally likely) in random slots, a loss
    (per-sample or coupling, equally likely) and its placement, 2-4 samples of 1-3 tokens."""
    layers = tuple(draw(st.lists(st.sampled_from(comp.LAYERS), min_size=1, max_size=3)))
    slots = [[] for _ in range(len(layers) + 1)]
    any_op = st.one_of(st.sampled_from(sorted(comp.ROW_OPS)), st.sampled_from(sorted(comp.MIXING_OPS)))
    for slot, op in draw(st.lists(st.tuples(st.integers(0, len(layers)), any_op), max_size=3)):
        if op in comp.DETACHING and slot == len(layers):
            op = "numpy_cumsum_add"  # nothing trainable after it: keep a gradient path
        slots[slot].append(op)
    per_sample = sorted(set(comp.LOSSES) - comp.MIXING_LOSSES)
    loss = draw(st.one_of(st.sampled_from(per_sample), st.sampled_from(sorted(comp.MIXING_LOSSES))))
    return comp.Composition(layers, tuple(tuple(s) for s in slots), loss, draw(st.sampled_from(comp.PLACEMENTS)),
                            n=draw(st.integers(2, 4)), t=draw(st.integers(1, 3)), seed=draw(st.integers(0, 999)),
                            clip=draw(st.sampled_from([0.1, 1.0, 100.0])))


def _between(op: str) -> comp.Composition:
    return comp.Composition(("linear", "linear"), ((), (op,), ()), "projection", n=8, t=1)


def _after(op: str) -> comp.Composition:
    return comp.Composition(("linear", "linear"), ((), ("tanh",), (op,)), "ce_sum", n=8, t=1)


def _loss(loss: str, placement: str = "outside", clip: float = 1.0) -> comp.Composition:
    return comp.Composition(("embedding", "linear"), ((), (), ()), loss, placement, n=8, t=2, clip=clip)


#: The issue's measured tracker leaks, Linear -> op -> Linear with n = 8: the fuzzer's examples.
TRACKER_LEAKS = [_between(op) for op in ("fft0", "cumsum0_", "put_", "masked_scatter", "data_assign", "numpy_cumsum",
                                         "numpy_cumsum_add", "detach_sub_mean0", "legacy_ctor_mean0", "gather_short",
                                         "scatter_short", "scatter_add_short")]

#: The issue's mixing after the last layer and in the loss (outside the model, and HF-style inside).
OUTPUT_AND_LOSS_LEAKS = {
    "batch_norm_after_last_linear": _after("batch_norm"),
    "gate_by_first_row_after_last_linear": _after("first_row_gate"),
    "setitem_batch_sum_after_last_linear": _after("setitem_batch_sum"),
    "contrastive_loss": _loss("contrastive"),
    "batch_baseline": _loss("batch_baseline"),
    # a divisor common to all rows cancels in rows that are clipped: C = 100 clips none
    "loss_by_batch_statistic": _loss("ce_by_batch_statistic", clip=100.0),
    "loss_by_label_count": _loss("ce_by_label_count", clip=100.0),
    "inside_mean_loss": _loss("ce_mean", "inside", clip=100.0),
    "loss_by_batch_size": _loss("ce_by_batch_size", clip=100.0),
    "loss_by_label_copy_count": _loss("ce_by_label_copy_count", clip=100.0),
}


def _with_examples(test):
    for case in TRACKER_LEAKS:
        test = example(case=case)(test)
    return test


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False)
@given(case=compositions())
@_with_examples
def test_fuzzed_composition_is_refused_or_exact(mode, case):
    assert_oracle(judge(case, mode))


def _compiled_without_graphs(model: nn.Module):
    """``torch.compile(model)`` with a backend that fails the test if Dynamo hands it a graph: under the controller
    a private forward runs eagerly (``tracking/compiled.py``), nothing of it is compiled."""
    def backend(graph, example_inputs):
        raise AssertionError(f"Dynamo compiled a graph of a private step:\n{graph.code}")
    return torch.compile(model, backend=backend)


@pytest.mark.parametrize("mode", ["bk", "hooks"])
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False)
@given(case=compositions())
@_with_examples
def test_fuzzed_composition_compiled_is_refused_or_exact_as_in_eager(mode, case):
    """The fuzzer with the model compiled after ``make_private(..., wrap_model=False)``: the oracle holds, and the
    verdict is the eager one (a refusal where eager refuses, exact where eager is)."""
    torch._dynamo.reset()
    compiled = judge(case, mode, _compiled_without_graphs)
    assert_oracle(compiled)
    if not RECORD:
        assert compiled["outcome"] == judge(case, mode)["outcome"], compiled.get("message", "")


@pytest.mark.parametrize("mode", ["bk", "hooks"])
@settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False)
@given(case=compositions())
@_with_examples
def test_fuzzed_composition_captured_is_refused_or_exact(mode, case):
    """The fuzzer through ``capture_step`` (the step traced under the tracker, its graph replayed): the oracle holds
    (refused, or exact with every move within its bound). Where eager is exact a captured step may still refuse
    (a value read into Python, numpy on the batch: not traceable), never the other way round."""
    captured = judge(case, mode, captured=True)
    assert_oracle(captured)
    if not RECORD and captured["outcome"] == "exact":
        assert judge(case, mode)["outcome"] == "exact"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(OUTPUT_AND_LOSS_LEAKS))
def test_mixing_after_the_last_layer_or_in_the_loss_is_refused(name, mode):
    """The batch-of-one reference cannot express these couplings: refusing is the only pass."""
    assert_oracle(judge(OUTPUT_AND_LOSS_LEAKS[name], mode), expected="refused")


# ---------------------------------------------------------------------------------- HF's built-in loss


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def long_and_short_rows() -> tuple:
    """``(input_ids, attention_mask, labels)``, 8 rows of 12 tokens: row 0 has 11 target tokens
    (after the causal shift), the seven others 2 (then padding, masked and ignored)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (8, 12), generator=g)
    mask = torch.zeros_like(ids)
    mask[0], mask[1:, :3] = 1, 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def hf_loss(model, ids, mask, labels):
    """HF's own loss, as users call it: the batch's token losses over the batch's token count."""
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def logits_token_sum(model, ids, mask, labels, *, pass_labels=True):
    """Each row's summed token cross-entropy from ``out.logits`` (per sample), summed over rows;
    with ``pass_labels`` the model also gets ``labels`` and returns its batch-mean ``out.loss``, unused."""
    out = model(input_ids=ids, attention_mask=mask, **({"labels": labels} if pass_labels else {}))
    logits, targets = out.logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("max_grad_norm", [1.0, 100.0])
def test_hf_built_in_loss_is_refused_or_made_per_sample(mode, max_grad_norm):
    """``model(input_ids=..., labels=...).loss.backward()`` after ``make_private(loss_reduction="sum")``:
    refused, or turned into each row's mean over its own target tokens (then exact against that
    row's HF loss computed alone, and removing the long row moves the update by <= C).

    Here the rows' own-mean gradient norms are 2.5 (long) and about 5; divided by the batch's 25
    target tokens they are 1.1 and 0.4: at C = 1 the short rows go unclipped and removing the long
    row rescales them (move 1.2 C without the fix); at C = 100 none is clipped."""
    found = oracle.verdict(tiny_gpt2(), long_and_short_rows(), hf_loss, mode, max_grad_norm)
    assert_oracle({"composition": f"HF GPT-2 out.loss.backward(), 8 rows (11 and 7x2 targets), C={max_grad_norm:g}",
                   "mixing": True, **found})


@pytest.mark.parametrize("mode", MODES)
def test_hf_model_given_labels_trains_exactly_on_a_per_sample_loss_of_its_logits(mode):
    """``out.loss`` (a batch mean) is returned but not back-propagated: the step must train as it
    does without ``labels``, exactly."""
    model, rows = tiny_gpt2(), long_and_short_rows()
    without = oracle.verdict(model, rows, lambda m, *b: logits_token_sum(m, *b, pass_labels=False), mode, C)
    given_labels = oracle.verdict(model, rows, logits_token_sum, mode, C)
    # torch's expanded weights cannot run GPT-2's Conv1D; every other mode must train it
    expected = without["outcome"] if mode == "ew" else "exact"
    assert_oracle({"composition": "HF GPT-2 given labels, backward of the logits' per-token sum", "mixing": False,
                   **given_labels}, expected=expected)
