"""The oracle on every built-in sampler through the controller: shapes drawn by hypothesis,
loss reductions sum and mean, batch first or not, hooks and functorch modes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dptorch.grad_sample import find_grad_sampler
from tests.helpers import check_per_sample_grads

SETTINGS = settings(max_examples=8, deadline=None)
reductions = st.sampled_from(["mean", "sum"])
batch_sizes = st.integers(1, 4)


def run(module, inputs, reduction, **kwargs):
    module.train()
    assert find_grad_sampler(module) is not None or kwargs.get("grad_sample_mode") == "functorch"
    check_per_sample_grads(module, inputs, loss_reduction=reduction, **kwargs)


@SETTINGS
@given(n=batch_sizes, middle=st.lists(st.integers(1, 3), max_size=2), d_in=st.integers(1, 5), d_out=st.integers(1, 5),
       bias=st.booleans(), reduction=reductions, batch_first=st.booleans())
def test_linear(n, middle, d_in, d_out, bias, reduction, batch_first):
    torch.manual_seed(0)
    shape = [n, *middle, d_in]
    if not batch_first and middle:
        shape[0], shape[1] = shape[1], shape[0]
    run(nn.Linear(d_in, d_out, bias=bias), (torch.randn(shape),), reduction, batch_first=batch_first or not middle)


@SETTINGS
@given(n=batch_sizes, dims=st.sampled_from([1, 2, 3]), groups=st.sampled_from([1, 2]), k=st.integers(1, 3),
       stride=st.integers(1, 2), dilation=st.integers(1, 2), padding=st.sampled_from([0, 1, "same"]),
       padding_mode=st.sampled_from(["zeros", "reflect", "replicate", "circular"]), reduction=reductions)
def test_conv(n, dims, groups, k, stride, dilation, padding, padding_mode, reduction):
    torch.manual_seed(0)
    if padding == "same":
        stride = 1
    conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](2 * groups, 2 * groups, k, stride=stride, dilation=dilation,
                                                         padding=padding, padding_mode=padding_mode, groups=groups)
    x = torch.randn(n, 2 * groups, *([6] * dims))
    run(conv, (x,), reduction)


@SETTINGS
@given(n=batch_sizes, t=st.integers(1, 4), vocab=st.integers(2, 8), pad=st.booleans(), reduction=reductions,
       batch_first=st.booleans())
def test_embedding(n, t, vocab, pad, reduction, batch_first):
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, 3, padding_idx=0 if pad else None)
    ids = torch.randint(0, vocab, (n, t) if batch_first else (t, n))
    run(emb, (ids,), reduction, batch_first=batch_first)


@SETTINGS
@given(n=batch_sizes, bag=st.integers(1, 4), mode=st.sampled_from(["sum", "mean", "max"]), reduction=reductions)
def test_embedding_bag(n, bag, mode, reduction):
    torch.manual_seed(0)
    run(nn.EmbeddingBag(7, 3, mode=mode), (torch.randint(0, 7, (n, bag)),), reduction)


@SETTINGS
@given(n=batch_sizes, kind=st.sampled_from(["layer", "group", "instance1", "instance2", "instance3", "rms"]),
       reduction=reductions)
def test_norms(n, kind, reduction):
    torch.manual_seed(0)
    module, shape = {
        "layer": (nn.LayerNorm(4), (n, 3, 4)),
        "group": (nn.GroupNorm(2, 4), (n, 4, 5)),
        "instance1": (nn.InstanceNorm1d(4, affine=True), (n, 4, 5)),
        "instance2": (nn.InstanceNorm2d(4, affine=True), (n, 4, 3, 3)),
        "instance3": (nn.InstanceNorm3d(4, affine=True), (n, 4, 2, 3, 2)),
        "rms": (nn.RMSNorm(4), (n, 3, 4)),
    }[kind]
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    run(module, (torch.randn(shape),), reduction)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "t5"])
def test_hf_rms_norm_family(family):
    transformers = pytest.importorskip("transformers")
    cls = {
        "llama": transformers.models.llama.modeling_llama.LlamaRMSNorm,
        "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm,
        "gemma": transformers.models.gemma.modeling_gemma.GemmaRMSNorm,
        "t5": transformers.models.t5.modeling_t5.T5LayerNorm,
    }[family]
    torch.manual_seed(0)
    module = cls(6)
    with torch.no_grad():
        module.weight.normal_()
    run(module, (torch.randn(3, 4, 6),), "mean")


def test_hf_conv1d():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    run(transformers.pytorch_utils.Conv1D(5, 4), (torch.randn(3, 2, 4),), "sum")


@SETTINGS
@given(n=st.integers(0, 3), reduction=reductions)
def test_functorch_mode_matches_on_a_mixed_model(n, reduction):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 2))
    if n == 0:
        reduction = "sum"
    run(model, (torch.randn(n, 5, 4),), reduction, grad_sample_mode="functorch")
