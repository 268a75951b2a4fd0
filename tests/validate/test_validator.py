"""ModuleValidator: validation, fixes (weights carried over exactly), custom fixers, a fixed ResNet."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks, UnsupportedModuleError, validation
from dptorch.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from dptorch.optim import DPOptimizer
from dptorch.validate import ModuleValidator, fixers, register_module_check, register_module_fixer
from dptorch.validate.fixers import largest_divisor_at_most
from tests.helpers import check_per_sample_grads


def incompatible_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 24, 3),
        nn.BatchNorm2d(24),
        nn.Sequential(nn.InstanceNorm2d(24, affine=True, track_running_stats=True)),
        nn.Flatten(0, -1),
    )


def test_validate_lists_every_problem_with_its_path():
    model = nn.ModuleDict(dict(cnn=incompatible_model(), rnn=nn.LSTM(4, 5), attention=nn.MultiheadAttention(8, 2), ok=nn.Linear(2, 2)))
    problems = ModuleValidator.validate(model)
    assert [(p.path, p.module_type) for p in problems] == [
        ("cnn.1", "BatchNorm2d"), ("cnn.2.0", "InstanceNorm2d"), ("rnn", "LSTM"), ("attention", "MultiheadAttention"),
    ]
    assert all("fix" in p.reason for p in problems)
    assert not ModuleValidator.is_valid(model)
    with pytest.raises(UnsupportedModuleError) as raised:
        ModuleValidator.validate(model, strict=True)
    for path in ("cnn.1", "cnn.2.0", "rnn", "attention"):
        assert path in str(raised.value)
    assert ModuleValidator.is_valid(nn.Linear(2, 2)) and ModuleValidator.validate(nn.Linear(2, 2), strict=True) == []


def test_frozen_recurrent_and_attention_layers_are_valid_and_left_alone():
    model = nn.Sequential(nn.LSTM(4, 5).requires_grad_(False), nn.MultiheadAttention(8, 2).requires_grad_(False))
    assert ModuleValidator.is_valid(model)
    fixed = ModuleValidator.fix(model)
    assert isinstance(fixed[0], nn.LSTM) and isinstance(fixed[1], nn.MultiheadAttention)


def test_fix_returns_a_copy_and_never_modifies_the_input():
    model = incompatible_model()
    before = copy.deepcopy(model.state_dict())
    fixed = ModuleValidator.fix(model)
    assert isinstance(model[1], nn.BatchNorm2d) and model[2][0].track_running_stats
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(fixed[1], nn.GroupNorm) and not fixed[2][0].track_running_stats
    assert fixed[0].weight is not model[0].weight
    assert ModuleValidator.is_valid(fixed)
    valid = nn.Linear(2, 2)
    assert ModuleValidator.fix(valid) is not valid


@pytest.mark.parametrize("channels,groups", [(1, 1), (7, 7), (24, 24), (64, 32), (96, 32), (48, 24), (100, 25), (37, 1)])
def test_group_count_is_the_largest_divisor_up_to_32(channels, groups):
    assert largest_divisor_at_most(channels, 32) == groups
    assert ModuleValidator.fix(nn.BatchNorm1d(channels)).num_groups == groups


@pytest.mark.parametrize("bn_type", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm])
def test_batch_norm_to_group_norm_carries_affine_weights(bn_type):
    bn = bn_type(6, eps=1e-3).double()
    with torch.no_grad():
        bn.weight.uniform_(), bn.bias.uniform_()
    bn.bias.requires_grad_(False)
    bn.eval()
    fixed = ModuleValidator.fix(bn)
    assert type(fixed) is nn.GroupNorm and fixed.num_groups == 6 and fixed.eps == 1e-3
    assert fixed.weight.dtype == torch.float64 and not fixed.training
    assert torch.equal(fixed.weight, bn.weight) and torch.equal(fixed.bias, bn.bias)
    assert fixed.weight.requires_grad and not fixed.bias.requires_grad


@pytest.mark.parametrize(
    "bn,expected",
    [(nn.BatchNorm1d(6), nn.InstanceNorm1d), (nn.BatchNorm2d(6), nn.InstanceNorm2d), (nn.BatchNorm3d(6), nn.InstanceNorm3d), (nn.SyncBatchNorm(6), nn.GroupNorm)],
)
def test_batch_norm_to_instance_norm_on_request(bn, expected):
    with torch.no_grad():
        bn.weight.uniform_()
    fixed = ModuleValidator.fix(bn, batchnorm="instancenorm")
    assert type(fixed) is expected and torch.equal(fixed.weight, bn.weight)
    if expected is nn.GroupNorm:
        assert fixed.num_groups == 6
        x = torch.randn(2, 6, 5, 4)
        reference = nn.InstanceNorm2d(6, affine=True)
        reference.load_state_dict(fixed.state_dict())
        torch.testing.assert_close(fixed(x), reference(x))
    else:
        assert not fixed.track_running_stats and ModuleValidator.is_valid(fixed)


def test_fix_options_are_checked():
    with pytest.raises(TypeError, match="batchnrom"):
        ModuleValidator.fix(nn.BatchNorm1d(4), batchnrom="instancenorm")
    with pytest.raises(ValueError, match="groupnorm"):
        ModuleValidator.fix(nn.BatchNorm1d(4), batchnorm="layernorm")


def test_instance_norm_running_stats_off():
    norm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
    fixed = ModuleValidator.fix(norm)
    assert not fixed.track_running_stats and fixed.running_mean is None
    assert "running_mean" not in fixed.state_dict()
    x = torch.randn(3, 4, 7)
    fixed.eval()  # eval mode too: normalised with the sample's own statistics
    torch.testing.assert_close(fixed(x), nn.functional.instance_norm(x, weight=norm.weight, bias=norm.bias))


@pytest.mark.parametrize(
    "layer,dp_type",
    [
        (nn.LSTM(4, 6, num_layers=2, bidirectional=True, proj_size=3, batch_first=True, dropout=0.1), DPLSTM),
        (nn.GRU(4, 6, bias=False), DPGRU),
        (nn.RNN(4, 6, nonlinearity="relu", num_layers=2), DPRNN),
    ],
)
def test_recurrent_layers_become_dp_layers_with_the_same_weights(layer, dp_type):
    layer.weight_hh_l0.requires_grad_(False)
    layer.eval()
    fixed = ModuleValidator.fix(layer)
    assert type(fixed) is dp_type and not fixed.training
    for name in ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional", "proj_size"):
        assert getattr(fixed, name) == getattr(layer, name, 0), name
    assert list(fixed.state_dict()) == list(layer.state_dict())
    assert all(torch.equal(fixed.state_dict()[k], v) for k, v in layer.state_dict().items())
    assert not fixed.weight_hh_l0.requires_grad and fixed.weight_ih_l0.requires_grad
    x = torch.randn(2, 5, 4)
    torch.testing.assert_close(fixed(x)[0], layer(x)[0])


@pytest.mark.parametrize("config", [dict(), dict(kdim=5, vdim=6, add_bias_kv=True, add_zero_attn=True, batch_first=True, bias=False)])
def test_multihead_attention_becomes_dp_attention_with_the_same_weights(config):
    layer = nn.MultiheadAttention(8, 2, dropout=0.1, **config)
    if config:
        layer.k_proj_weight.requires_grad_(False)
    else:
        layer.in_proj_weight.requires_grad_(False)
    fixed = ModuleValidator.fix(layer).eval()
    layer.eval()
    assert type(fixed) is DPMultiheadAttention and fixed.dropout == 0.1
    assert not fixed.k_proj.weight.requires_grad and fixed.v_proj.weight.requires_grad is bool(config)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 4, config.get("kdim", 8)), torch.randn(3, 4, config.get("vdim", 8))
    for a, b in zip(layer(q, k, v), fixed(q, k, v)):
        torch.testing.assert_close(b, a)


def test_a_module_used_twice_is_replaced_once_everywhere():
    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), shared, nn.Linear(4, 4), shared)
    fixed = ModuleValidator.fix(model)
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1] is fixed[3]


class Twice(nn.Module):
    """A user module that is incompatible until its flag is cleared."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.mixes_samples = True

    def forward(self, x):
        return self.linear(x)


@pytest.fixture
def private_registries(monkeypatch):
    monkeypatch.setattr(validation, "_CHECKS", {k: list(v) for k, v in validation._CHECKS.items()})
    monkeypatch.setattr(fixers, "_FIXERS", dict(fixers._FIXERS))


def test_custom_checks_and_fixers(private_registries):
    @register_module_check(Twice)
    def mixes(module):
        return "mixes samples; ModuleValidator.fix clears the flag" if module.mixes_samples else None

    model = nn.Sequential(Twice(), nn.BatchNorm1d(3))
    with pytest.raises(UnsupportedModuleError, match=r"0 \(Twice\)"):
        ModuleValidator.fix(model)

    seen = {}

    @register_module_fixer(Twice)
    def clear_flag(module, *, scale: float = 1.0):
        seen["scale"] = scale
        module.mixes_samples = False
        return module

    fixed = ModuleValidator.fix(model, scale=2.0, batchnorm="instancenorm")
    assert seen["scale"] == 2.0 and not fixed[0].mixes_samples and isinstance(fixed[1], nn.InstanceNorm1d)
    assert model[0].mixes_samples


def test_a_fixer_that_does_not_fix_is_reported(private_registries):
    @register_module_fixer(nn.BatchNorm2d)
    def keep(module):
        return module

    with pytest.raises(UnsupportedModuleError, match="could not make the model compatible"):
        ModuleValidator.fix(incompatible_model())


# ---------------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 48, stride=2))
        self.head = nn.Linear(48, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def test_fixed_resnet_trains_privately():
    torch.manual_seed(0)
    model = TinyResNet()
    assert len(ModuleValidator.validate(model)) == 6
    fixed = ModuleValidator.fix(model)
    assert ModuleValidator.is_valid(fixed)
    norms = [m for m in fixed.modules() if isinstance(m, nn.GroupNorm)]
    assert [m.num_groups for m in norms] == [8, 8, 8, 24, 24, 24]  # 48 channels: 24 groups

    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    before = copy.deepcopy(fixed.state_dict())
    with GradSampleHooks(fixed) as hooks:
        optimizer = DPOptimizer(
            torch.optim.SGD(fixed.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.5, max_grad_norm=1.0,
            expected_batch_size=len(x),
        )
        for _ in range(3):
            nn.functional.cross_entropy(fixed(x), y).backward()
            samples = hooks.grad_samples
            assert set(samples) == set(fixed.parameters())
            assert all(samples[p].shape == (len(x), *p.shape) for p in fixed.parameters())
            optimizer.step()
            optimizer.zero_grad()
        optimizer.detach()
    assert all(not torch.equal(before[name], p) for name, p in fixed.named_parameters())
    assert all(torch.isfinite(p).all() for p in fixed.parameters())
    check_per_sample_grads(fixed, (x,))
