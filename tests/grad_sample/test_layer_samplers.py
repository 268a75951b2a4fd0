"""Built-in layer samplers against per-sample gradients computed with torch.func on the module itself."""

from __future__ import annotations

import weakref
import copy
import math
import subprocess
import sys
from typing import Dict, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap

from dptorch.grad_sample.layers import normalization as norms
from dptorch.grad_sample.layers.conv import unfold_strided
from dptorch.grad_sample.layers.hf_conv1d import hf_conv1d_grad_sampler
from dptorch.grad_sample.layers.normalization import hf_rms_norm_grad_sampler, looks_like_hf_rms_norm, verify_duck_sampler
from dptorch.grad_sample.layers.registry import find_grad_sampler

FEW = settings(max_examples=12, deadline=None)
SOME = settings(max_examples=25, deadline=None)
FLOAT64 = dict(rtol=1e-4, atol=1e-6)
FLOAT32 = dict(rtol=1e-4, atol=1e-5)


def torch_func_reference(module: nn.Module, x: torch.Tensor, backprops: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per-sample grads of ``sum(module(x_i) * backprops_i)`` for the trainable direct parameters."""
    params = {name: p.detach() for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    if x.shape[0] == 0:  # some forwards (HF Conv1D's view(-1, ...)) cannot be vmapped over an empty batch
        return {name: p.new_zeros(0, *p.shape) for name, p in params.items()}

    def sample_loss(p, x_i, b_i):
        return (functional_call(module, p, (x_i.unsqueeze(0),)) * b_i.unsqueeze(0)).sum()

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, backprops)


def sampled_grads(
    module: nn.Module, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """Run the registered sampler; check shapes and dtypes; key the result by parameter name."""
    result = find_grad_sampler(module)(module, activations, backprops)
    names = {p: name for name, p in module.named_parameters(recurse=False)}
    batch = backprops.shape[0]
    for param, grad_sample in result.items():
        assert grad_sample.shape == (batch, *param.shape)
        assert grad_sample.dtype == param.dtype
    return {names[p]: g for p, g in result.items()}


def assert_grads_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], **tolerance) -> None:
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name].to(got[name].dtype), **tolerance)


def check_against_torch_func(module: nn.Module, x: torch.Tensor, **tolerance) -> None:
    with torch.no_grad():
        out = module(x)
    backprops = torch.randn_like(out)
    assert_grads_close(sampled_grads(module, (x,), backprops), torch_func_reference(module, x, backprops), **tolerance)


# ----------------------------------------------------------------------------- Linear and HF Conv1D


@SOME
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(0, 4),
    middle=st.lists(st.integers(1, 3), max_size=2),
    in_features=st.integers(1, 4),
    out_features=st.integers(1, 4),
    bias=st.booleans(),
)
def test_linear_matches_torch_func(seed, batch, middle, in_features, out_features, bias):
    torch.manual_seed(seed)
    module = nn.Linear(in_features, out_features, bias=bias).double()
    check_against_torch_func(module, torch.randn(batch, *middle, in_features, dtype=torch.float64), **FLOAT64)


def test_linear_float32_keeps_dtype_and_accepts_zero_length_middle_dim():
    module = nn.Linear(5, 3)
    check_against_torch_func(module, torch.randn(4, 2, 7, 5), **FLOAT32)
    check_against_torch_func(module, torch.randn(4, 0, 5), **FLOAT32)


def test_linear_mixed_precision_backprops_give_parameter_dtype():
    module = nn.Linear(5, 3)
    grads = sampled_grads(module, (torch.randn(2, 5),), torch.randn(2, 3, dtype=torch.bfloat16))
    assert grads["weight"].dtype == torch.float32


@FEW
@given(seed=st.integers(0, 2**16), batch=st.integers(0, 4), seq=st.integers(1, 3))
def test_hf_conv1d_matches_torch_func(seed, batch, seq):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(seed)
    module = Conv1D(nf=3, nx=5).double()
    assert find_grad_sampler(module) is hf_conv1d_grad_sampler
    check_against_torch_func(module, torch.randn(batch, seq, 5, dtype=torch.float64), **FLOAT64)


def test_hf_conv1d_is_verified_and_wrong_orientation_is_not_matched():
    from transformers.pytorch_utils import Conv1D

    assert verify_duck_sampler(Conv1D(nf=3, nx=5))

    class Conv1D(nn.Module):  # noqa: F811  (a look-alike storing the weight as (out, in))
        def __init__(self):
            super().__init__()
            self.nf = 3
            self.weight = nn.Parameter(torch.randn(3, 5))

        def forward(self, x):
            return x @ self.weight.t()

    assert find_grad_sampler(Conv1D()) is None


def test_layers_import_without_transformers():
    # Loading the registry loads its package, which registers the built-in layer families
    # (the registry imports none of them), and none of that imports transformers.
    code = (
        "import sys, torch, dptorch.grad_sample.layers.registry as r; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'), "
        "r.find_norm_sampler(torch.nn.Linear(2, 2)) is not None, r.find_grad_sampler(torch.nn.Conv1d(1, 1, 1)) is not None)"
    )
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert result.stdout.strip() == "[] True True"


# ----------------------------------------------------------------------------- Convolutions


@st.composite
def conv_configs(draw):
    n_spatial = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 2))
    kernel = draw(st.lists(st.integers(1, 3), min_size=n_spatial, max_size=n_spatial))
    dilation = draw(st.lists(st.integers(1, 2), min_size=n_spatial, max_size=n_spatial))
    padding = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    stride = [1] * n_spatial if padding == "same" else draw(st.lists(st.integers(1, 2), min_size=n_spatial, max_size=n_spatial))
    if padding == "int":
        padding = draw(st.integers(0, 2))
    elif padding == "tuple":
        padding = tuple(draw(st.lists(st.integers(0, 2), min_size=n_spatial, max_size=n_spatial)))
    # Inputs at least 3 wide (reflect needs padding < size) and at least one dilated kernel wide.
    size = [max(3, d * (k - 1) + 1) + draw(st.integers(0, 2 if n_spatial < 3 else 1)) for k, d in zip(kernel, dilation)]
    return dict(
        n_spatial=n_spatial,
        in_channels=groups * draw(st.integers(1, 2)),
        out_channels=groups * draw(st.integers(1, 2)),
        kernel_size=tuple(kernel),
        stride=tuple(stride),
        dilation=tuple(dilation),
        padding=padding,
        groups=groups,
        padding_mode=draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"])),
        bias=draw(st.booleans()),
        batch=draw(st.integers(0, 3)),
        size=size,
    )


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), config=conv_configs())
def test_conv_matches_torch_func(seed, config):
    torch.manual_seed(seed)
    conv_cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[config.pop("n_spatial")]
    batch, size = config.pop("batch"), config.pop("size")
    module = conv_cls(**config).double()
    x = torch.randn(batch, config["in_channels"], *size, dtype=torch.float64)
    check_against_torch_func(module, x, **FLOAT64)


@pytest.mark.parametrize("conv_cls", [nn.Conv1d, nn.Conv2d, nn.Conv3d])
def test_conv_float32_same_padding_with_even_kernel(conv_cls):
    module = conv_cls(4, 6, kernel_size=4, padding="same", dilation=1, groups=2, padding_mode="circular")
    n_spatial = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[conv_cls]
    check_against_torch_func(module, torch.randn(3, 4, *[5] * n_spatial), **FLOAT32)


@FEW
@given(
    seed=st.integers(0, 2**16),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
)
def test_strided_unfold_equals_torch_unfold(seed, kernel, dilation, stride):
    torch.manual_seed(seed)
    x = torch.randn(2, 3, 7, 8)
    expected = F.unfold(x, kernel, dilation=dilation, stride=stride)
    torch.testing.assert_close(unfold_strided(x, kernel, dilation, stride), expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------- Embeddings


@SOME
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(0, 4),
    rest=st.lists(st.integers(1, 3), max_size=2),
    num_embeddings=st.integers(1, 8),
    dim=st.integers(1, 4),
    use_padding=st.booleans(),
    scale_grad_by_freq=st.booleans(),
)
def test_embedding_matches_torch_func(seed, batch, rest, num_embeddings, dim, use_padding, scale_grad_by_freq):
    torch.manual_seed(seed)
    padding_idx = int(torch.randint(num_embeddings, ())) if use_padding else None
    module = nn.Embedding(num_embeddings, dim, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    module = module.double()
    check_against_torch_func(module, torch.randint(num_embeddings, (batch, *rest)), **FLOAT64)


def test_embedding_padding_row_is_zero_and_max_norm_is_plain_scatter():
    module = nn.Embedding(6, 3, padding_idx=-1, max_norm=0.5).double()
    x = torch.tensor([[5, 1, 5], [2, 2, 0]])
    backprops = torch.randn(2, 3, 3, dtype=torch.float64)
    with torch.no_grad():
        module(x)  # renormalises the looked-up rows in place, as training would
    plain = nn.Embedding(6, 3, padding_idx=5).double()
    plain.weight.data.copy_(module.weight.data)
    got = sampled_grads(module, (x,), backprops)
    assert_grads_close(got, torch_func_reference(plain, x, backprops), **FLOAT64)
    assert torch.all(got["weight"][:, 5] == 0)


def embedding_bag_reference(
    module: nn.EmbeddingBag,
    bags: Sequence[torch.Tensor],
    bag_weights: Optional[Sequence[torch.Tensor]],
    backprops: torch.Tensor,
) -> Dict[str, torch.Tensor]:
    """torch.func grad of each bag alone (bags are ragged, so one call per bag).

    ``scale_grad_by_freq`` is applied by hand (divide each row by its count in the bag, as the docs
    and nn.Embedding do): torch's CPU embedding_bag backward divides by the wrong count
    (pytorch/pytorch#190063).
    """
    params = {"weight": module.weight.detach()}
    unscaled = copy.deepcopy(module)
    unscaled.scale_grad_by_freq = False
    per_bag = []
    for b, bag in enumerate(bags):
        offsets = torch.tensor([0, len(bag)] if module.include_last_offset else [0])
        weights = None if bag_weights is None else bag_weights[b]

        def bag_loss(p):
            out = functional_call(unscaled, p, (bag, offsets), {"per_sample_weights": weights})
            return (out * backprops[b]).sum()

        bag_grad = grad(bag_loss)(params)["weight"]
        if module.scale_grad_by_freq:
            bag_grad = bag_grad / torch.bincount(bag, minlength=module.num_embeddings).clamp(min=1).unsqueeze(-1)
        per_bag.append(bag_grad)
    return {"weight": torch.stack(per_bag) if per_bag else torch.zeros(0, *module.weight.shape, dtype=torch.float64)}


@SOME
@given(
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["sum", "mean", "max"]),
    bag_sizes=st.lists(st.integers(0, 4), max_size=4),
    two_dimensional=st.booleans(),
    include_last_offset=st.booleans(),
    use_padding=st.booleans(),
    use_weights=st.booleans(),
    scale_grad_by_freq=st.booleans(),
)
def test_embedding_bag_matches_torch_func(
    seed, mode, bag_sizes, two_dimensional, include_last_offset, use_padding, use_weights, scale_grad_by_freq
):
    torch.manual_seed(seed)
    num_embeddings, dim = 6, 3
    use_weights = use_weights and mode == "sum"
    scale_grad_by_freq = scale_grad_by_freq and mode != "max"
    module = nn.EmbeddingBag(
        num_embeddings,
        dim,
        mode=mode,
        padding_idx=2 if use_padding else None,
        include_last_offset=include_last_offset and not two_dimensional,
        scale_grad_by_freq=scale_grad_by_freq,
    ).double()
    if two_dimensional:
        length = bag_sizes[0] if bag_sizes else 2
        bag_sizes = [length] * len(bag_sizes)
    bags = [torch.randint(num_embeddings, (size,)) for size in bag_sizes]
    bag_weights = [torch.randn(size, dtype=torch.float64) for size in bag_sizes] if use_weights else None
    backprops = torch.randn(len(bags), dim, dtype=torch.float64)
    if two_dimensional:
        activations = (torch.stack(bags) if bags else torch.zeros(0, length, dtype=torch.long),)
        if use_weights:
            activations += (torch.stack(bag_weights) if bags else torch.zeros(0, length, dtype=torch.float64),)
    else:
        starts = torch.tensor([0] + bag_sizes).cumsum(0)
        offsets = starts if module.include_last_offset else starts[:-1]
        activations = (torch.cat(bags) if bags else torch.zeros(0, dtype=torch.long), offsets)
        if use_weights:
            activations += (torch.cat(bag_weights) if bags else torch.zeros(0, dtype=torch.float64),)
    got = sampled_grads(module, activations, backprops)
    assert_grads_close(got, embedding_bag_reference(module, bags, bag_weights, backprops), **FLOAT64)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_embedding_bag_two_dimensional_matches_vmap_reference():
    module = nn.EmbeddingBag(7, 4, mode="mean").double()
    check_against_torch_func(module, torch.randint(7, (3, 5)), **FLOAT64)


# ----------------------------------------------------------------------------- torch norm layers


@SOME
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(0, 4),
    middle=st.lists(st.integers(1, 3), max_size=2),
    normalized=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    bias=st.booleans(),
)
def test_layer_norm_matches_torch_func(seed, batch, middle, normalized, bias):
    torch.manual_seed(seed)
    module = nn.LayerNorm(normalized, bias=bias).double()
    nn.init.normal_(module.weight)
    check_against_torch_func(module, torch.randn(batch, *middle, *normalized, dtype=torch.float64), **FLOAT64)


@SOME
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(0, 4),
    groups=st.integers(1, 3),
    channels_per_group=st.integers(1, 3),
    spatial=st.lists(st.integers(1, 3), max_size=2),
)
def test_group_norm_matches_torch_func(seed, batch, groups, channels_per_group, spatial):
    assume(channels_per_group * math.prod(spatial) > 1)  # group_norm needs two values per group
    torch.manual_seed(seed)
    module = nn.GroupNorm(groups, groups * channels_per_group).double()
    channels = groups * channels_per_group
    check_against_torch_func(module, torch.randn(batch, channels, *spatial, dtype=torch.float64), **FLOAT64)


@SOME
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 4),
    n_spatial=st.integers(1, 3),
    channels=st.integers(1, 3),
    running_stats_in_eval=st.booleans(),
)
def test_instance_norm_matches_torch_func(seed, batch, n_spatial, channels, running_stats_in_eval):
    torch.manual_seed(seed)
    norm_cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[n_spatial]
    module = norm_cls(channels, affine=True, track_running_stats=running_stats_in_eval).double()
    if running_stats_in_eval:
        module.running_mean.normal_()
        module.running_var.uniform_(0.5, 2.0)
        module.eval()
    x = torch.randn(batch, channels, *[3] * n_spatial, dtype=torch.float64)
    check_against_torch_func(module, x, **FLOAT64)


def test_instance_norm_in_training_uses_input_stats_and_leaves_running_stats_alone():
    tracking = nn.InstanceNorm2d(3, affine=True, track_running_stats=True).double()
    plain = nn.InstanceNorm2d(3, affine=True).double()
    x, backprops = torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64)
    assert_grads_close(sampled_grads(tracking, (x,), backprops), torch_func_reference(plain, x, backprops), **FLOAT64)
    assert torch.all(tracking.running_mean == 0) and torch.all(tracking.running_var == 1)
    empty = sampled_grads(tracking, (x[:0],), backprops[:0])
    assert empty["weight"].shape == (0, 3)


@FEW
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(0, 4),
    middle=st.lists(st.integers(1, 3), max_size=2),
    normalized=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    eps=st.sampled_from([None, 1e-5]),
)
def test_rms_norm_matches_torch_func(seed, batch, middle, normalized, eps):
    torch.manual_seed(seed)
    module = nn.RMSNorm(normalized, eps=eps).double()
    check_against_torch_func(module, torch.randn(batch, *middle, *normalized, dtype=torch.float64), **FLOAT64)


# ----------------------------------------------------------------------------- frozen parameters


def test_frozen_parameters_are_skipped_without_touching_activations():
    unusable = (torch.empty(0),)  # any use of the activation would fail on its shape
    cases = [
        (nn.Linear(4, 3), "weight", torch.randn(2, 3)),
        (nn.Conv2d(2, 3, 3), "weight", torch.randn(2, 3, 4, 4)),
        (nn.LayerNorm(3), "weight", torch.randn(2, 5, 3)),
        (nn.GroupNorm(1, 3), "weight", torch.randn(2, 3, 4)),
    ]
    for module, frozen, backprops in cases:
        getattr(module, frozen).requires_grad_(False)
        assert set(sampled_grads(module, unusable, backprops)) == {"bias"}
    for module in [nn.Embedding(5, 3), nn.EmbeddingBag(5, 3), nn.RMSNorm(3)]:
        module.weight.requires_grad_(False)
        assert sampled_grads(module, unusable, torch.randn(2, 3)) == {}


def test_only_trainable_parameters_match_torch_func():
    module = nn.Linear(4, 3).double()
    module.bias.requires_grad_(False)
    check_against_torch_func(module, torch.randn(3, 2, 4, dtype=torch.float64), **FLOAT64)
    conv = nn.Conv1d(2, 4, 3, groups=2).double()
    conv.weight.requires_grad_(False)
    check_against_torch_func(conv, torch.randn(3, 2, 6, dtype=torch.float64), **FLOAT64)


# ----------------------------------------------------------------------------- HF RMSNorm family


def hf_rms_norms(hidden: int):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    modules = [LlamaRMSNorm(hidden, eps=1e-6), Qwen2RMSNorm(hidden, eps=1e-5), GemmaRMSNorm(hidden), T5LayerNorm(hidden)]
    for module in modules:
        nn.init.normal_(module.weight)
    return modules


@pytest.mark.parametrize("index", range(4))
def test_hf_rms_norms_use_duck_rule_and_match_torch_func(index):
    torch.manual_seed(index)
    module = hf_rms_norms(6)[index]
    assert find_grad_sampler(module) is hf_rms_norm_grad_sampler
    assert verify_duck_sampler(module)
    for batch in (0, 3):
        check_against_torch_func(module, torch.randn(batch, 4, 6) * 3 + 1, **FLOAT32)
    check_against_torch_func(module.double(), torch.randn(2, 2, 4, 6, dtype=torch.float64), rtol=1e-4, atol=1e-5)


def test_hf_rms_norm_in_bfloat16_keeps_dtype():
    module = hf_rms_norms(8)[0].to(torch.bfloat16)
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    backprops = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    got = sampled_grads(module, (x,), backprops)
    want = torch_func_reference(module.float(), x.float(), backprops.float())
    torch.testing.assert_close(got["weight"].float(), want["weight"], rtol=2e-2, atol=2e-2)


class FakeRMSNorm(nn.Module):
    """Named and shaped like an RMSNorm, but computes a LayerNorm."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return F.layer_norm(hidden_states, hidden_states.shape[-1:], self.weight, None, self.variance_epsilon)


class GatedRMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = 1e-6

    def forward(self, hidden_states, gate=None):
        return hidden_states * self.weight


def test_look_alike_is_matched_by_the_duck_rule_but_fails_verification():
    frozen_first = FakeRMSNorm(16).requires_grad_(False)  # a frozen first instance must not vouch for the class
    assert looks_like_hf_rms_norm(frozen_first)
    assert not verify_duck_sampler(frozen_first)
    assert find_grad_sampler(FakeRMSNorm(16)) is None  # the registry falls back to torch.func
    assert not looks_like_hf_rms_norm(GatedRMSNorm(4))
    assert find_grad_sampler(GatedRMSNorm(4)) is None


def test_verification_is_cached_per_instance(monkeypatch):
    calls = []

    def counting(module, sampler):
        calls.append(module)
        return True

    monkeypatch.setattr(norms, "_VERIFIED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(norms, "sampler_matches_torch_func", counting)
    llama, qwen, _, _ = hf_rms_norms(4)
    other = type(llama)(8)
    for module in [llama, other, qwen, llama, other]:
        assert verify_duck_sampler(module)
    assert calls == [llama, other, qwen]


def test_verification_leaves_the_module_alone_and_skips_its_hooks():
    module = hf_rms_norms(4)[0].to(torch.bfloat16)
    weight_before = module.weight.detach().clone()
    seen = []
    module.register_forward_hook(lambda mod, inputs, output: seen.append(inputs))
    assert norms.sampler_matches_torch_func(module, hf_rms_norm_grad_sampler)
    assert seen == []
    assert module.weight.dtype == torch.bfloat16 and torch.equal(module.weight, weight_before)
    assert list(module._parameters) == ["weight"]
