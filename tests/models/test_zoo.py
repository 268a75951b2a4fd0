"""Every family of the zoo (``zoo.py``), in every mode, against the batch-of-one oracle.

A private step's per-sample gradients (hooks, functorch), or its per-sample norms and clipped sums
(bk, ghost), equal those of each sample run alone, at a sequence length unlike the batch size and
at one equal to it (where sizes alone cannot tell a batch from a sequence); with tied embeddings
where the family ties them, and with LoRA adapters (PEFT) in place of the full parameters.
"""

from __future__ import annotations

import pytest
import torch

from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError
from tests.grad_sample.oracle import assert_captured_exact, assert_exact
from tests.helpers import single_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.models.zoo import ZOO

peft = pytest.importorskip("peft")

MODES = ("bk", "hooks", "ghost", "functorch")
SIZES = {"T != n": (3, 5), "T == n": (4, 4)}
# (family, mode) -> what the refusal names: without a grad sampler (the torch.func fallback), Mixtral's
# experts sort the tokens of all samples by expert and run one grouped matmul over them (torch._grouped_mm),
# which the batch tracker does not follow; the other modes take the expert banks' rule (layers/experts.py)
REFUSED = {("mixtral", "functorch"): r"mixes or merges its samples \(_grouped_mm, an operation the batch tracker"}


def run(name, model, mode, n, t, compile_model=None):
    family = ZOO[name]
    inputs = family.inputs(n, t, torch.Generator().manual_seed(n * 31 + t))
    dims = {key: 0 for key in inputs}
    if (name, mode) in REFUSED:
        with pytest.raises(PerSampleGradientError, match=REFUSED[name, mode]):
            assert_exact(model, inputs, dims, family.loss, mode, n, compile_model=compile_model)
        return
    assert_exact(model, inputs, dims, family.loss, mode, n, compile_model=compile_model)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(ZOO))
def test_family_is_exact(name, mode, size):
    torch.manual_seed(0)
    model = ZOO[name].build()
    if ZOO[name].tied is not None:
        assert ZOO[name].tied(model), f"{name} was meant to tie its output embedding to its input embedding"
    run(name, model, mode, *SIZES[size])


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("mode", ["bk", "hooks"])
@pytest.mark.parametrize("name", list(ZOO))
def test_family_compiled_after_the_controller_is_exact_and_compiles_nothing_while_followed(name, mode, size):
    """``torch.compile(model)`` after the controller attached (``make_private(..., wrap_model=False)``'s order):
    the private forward runs eagerly under the tracker (``tracking/compiled.py``), so it is exact, and Dynamo hands
    its backend no graph of it."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    run(name, ZOO[name].build(), mode, *SIZES[size], compile_model=lambda model: torch.compile(model, backend=backend))
    assert graphs == []
    assert torch._C._dynamo.eval_frame.get_eval_frame_callback() is None  # Dynamo's callback is back where it was


LORA = [name for name in ZOO if ZOO[name].lora_targets]


@pytest.mark.parametrize("mode", ["bk", "ghost", "hooks"])
@pytest.mark.parametrize("name", LORA)
def test_lora_adapters_are_exact(name, mode):
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=list(ZOO[name].lora_targets), init_lora_weights=False)
    model = peft.get_peft_model(ZOO[name].build(), config)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    run(name, model, mode, *SIZES["T != n"])


def test_zoo_spans_the_families():
    assert {f.kind for f in ZOO.values()} == {"encoder", "decoder", "seq2seq", "vision"}
    assert sum(f.tied is not None for f in ZOO.values()) >= 4


def test_deberta_without_attention_mask_is_refused():
    """Given no attention_mask, DeBERTa builds one of ones from the batch's shape: shared by the samples but
    with the batch's rows, so replaying its attention for one sample would count the sample once per row."""
    model = ZOO["deberta"].build()
    inputs = ZOO["deberta"].inputs(3, 5, torch.Generator().manual_seed(0))
    with GradSampleHooks(model, loss_reduction="sum"):
        with pytest.raises(PerSampleGradientError, match=r"DisentangledSelfAttention, replayed for one sample.*attention_mask"):
            ZOO["deberta"].loss(model(input_ids=inputs["input_ids"])).sum().backward()


@pytest.mark.parametrize("mode", ["bk", "hooks"])
@pytest.mark.parametrize("name", list(ZOO))
def test_family_captured_is_exact_or_refused_naming_why(name, mode):
    """``capture_step``: the graph traced under the tracker gives the oracle's norms and clipped sums where the
    sequence length equals the batch size. Mixtral's experts are refused at the trace: its grouped matmul has no
    float32 CPU kernel on fake tensors (torch 2.13), and its eager routing reads values into Python."""
    torch.manual_seed(0)
    n, t = SIZES["T == n"]
    inputs = ZOO[name].inputs(n, t, torch.Generator().manual_seed(n * 31 + t))
    if name == "mixtral":
        with pytest.raises(PerSampleGradientError, match="tracing the step on fake tensors failed|reads a tensor's value"):
            assert_captured_exact(ZOO[name].build(), inputs, ZOO[name].loss, mode, n)
        return
    assert_captured_exact(ZOO[name].build(), inputs, ZOO[name].loss, mode, n)


@pytest.mark.parametrize("name", LORA)
def test_lora_adapters_captured_are_exact(name):
    """LoRA adapters (peft) through ``capture_step`` (bk): the traced graph gives the oracle's norms and clipped sums,
    the frozen base's products in it but none of its per-sample work (the GPU target's set-up, a Llama with LoRA)."""
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=list(ZOO[name].lora_targets), init_lora_weights=False)
    model = peft.get_peft_model(ZOO[name].build(), config)
    n, t = SIZES["T == n"]
    inputs = ZOO[name].inputs(n, t, torch.Generator().manual_seed(n * 31 + t))
    assert_captured_exact(model, inputs, ZOO[name].loss, "bk", n)
