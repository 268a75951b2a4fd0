"""The Opacus 1.6 paths its own test suite imports: each does the real thing on dptorch's internals,
checked against dptorch's reference behaviour (the batch-of-one gradient, torch's own ops)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

import dptorch  # noqa: F401  (installs the served paths)
from dptorch.accounting.factory import ACCOUNTANTS
from dptorch.accounting.rdp import RDPAccountant
from dptorch.compat.unmapped import OpacusCompatibilityError
from dptorch.grad_sample import GradSampleModule, register_grad_sampler
from dptorch.grad_sample.errors import UnsupportedModuleError
from tests.helpers import check_per_sample_grads, reference_per_sample_grads


# ------------------------------------------------------------------ per_sample_gradients_utils


def test_the_check_accepts_dptorch_and_compares_with_micro_batching():
    from dptorch.utils.per_sample_gradients_utils import (
        check_per_sample_gradients_are_correct,
        compute_grad_samples_microbatch_and_opacus,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 2), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))
    x = torch.randn(5, 3, 5)
    for mode in ("hooks", "functorch", "ew"):
        assert check_per_sample_gradients_are_correct(x, model, grad_sample_mode=mode)
    reference, computed = compute_grad_samples_microbatch_and_opacus(x, model, loss_reduction="sum")
    assert set(reference) == {name for name, _ in model.named_parameters()} == set(computed)
    for name, param in model.named_parameters():  # the reference is the gradient of each sample alone
        alone = model[3](model[2](model[1](model[0](x[2:3])))).abs().sum()
        assert torch.allclose(reference[name][2], torch.autograd.grad(alone, param)[0], atol=1e-6)
        assert torch.allclose(computed[name], reference[name], atol=1e-5)
    with pytest.raises(RuntimeError, match="non-empty"):
        check_per_sample_gradients_are_correct(x[:0], model)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.weight


def test_the_check_rejects_a_wrong_grad_sampler():
    from dptorch.utils.per_sample_gradients_utils import check_per_sample_gradients_are_correct

    @register_grad_sampler(_Scaled)
    def summed_over_the_batch(module, activations, backprops):  # every row gets the batch's gradient
        total = (activations[0] * backprops).sum(0, keepdim=True)
        return {module.weight: total.expand(activations[0].shape[0], -1).contiguous()}

    assert not check_per_sample_gradients_are_correct(torch.randn(4, 3), _Scaled())


def test_packed_sequences_are_compared_sequence_by_sequence_in_input_order():
    from dptorch.layers import DPLSTM
    from dptorch.utils.packed_sequences import _gen_packed_data, compute_seq_lengths
    from dptorch.utils.per_sample_gradients_utils import check_per_sample_gradients_are_correct, unpack_packedsequences

    torch.manual_seed(1)
    packed = _gen_packed_data(4, 5, 3, batch_first=True, sorted_=False)
    lengths = pad_packed_sequence(packed, batch_first=True)[1]
    assert compute_seq_lengths(packed.batch_sizes) == sorted(lengths.tolist(), reverse=True)
    sequences = [torch.randn(length, 2) for length in (2, 4, 1)]
    assert all(torch.equal(a, b) for a, b in zip(unpack_packedsequences(pack_sequence(sequences, enforce_sorted=False)),
                                                 sequences))
    assert check_per_sample_gradients_are_correct(packed, DPLSTM(3, 4, batch_first=True), batch_first=True)


# ------------------------------------------------------------------ small helpers


def test_module_utils():
    from dptorch.utils.module_utils import are_state_dict_equal, clone_module, trainable_modules, trainable_parameters

    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    copy = clone_module(model)
    assert are_state_dict_equal(model.state_dict(), copy.state_dict())
    with torch.no_grad():
        copy[1].bias.add_(1.0)
    assert not are_state_dict_equal(model.state_dict(), copy.state_dict())
    assert not are_state_dict_equal(model.state_dict(), {})
    assert [name for name, _ in trainable_parameters(model)] == ["0.bias", "1.weight", "1.bias"]
    assert [name for name, _ in trainable_modules(model)] == ["0", "1"]


def test_validator_errors_are_what_dptorch_raises():
    from dptorch.validators import ModuleValidator
    from dptorch.validators.errors import IllegalModuleConfigurationError, UnsupportedError
    from dptorch.validators.errors import UnsupportedModuleError as OpacusName

    assert OpacusName is UnsupportedError is UnsupportedModuleError
    assert issubclass(IllegalModuleConfigurationError, UnsupportedModuleError)
    with pytest.raises(OpacusName):
        ModuleValidator.validate(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), strict=True)


def test_unfold2d_is_torch_unfold_and_pads_same_as_the_convolution():
    from dptorch.utils.tensor_utils import unfold2d

    x, weight = torch.randn(2, 3, 7, 6), torch.randn(4, 3, 3, 2)
    options = dict(kernel_size=(3, 2), stride=(1, 1), dilation=(2, 1))
    assert torch.equal(unfold2d(x, padding=(1, 0), **options), F.unfold(x, padding=(1, 0), **options))
    patches = unfold2d(x, padding="same", **options)  # (B, C*kh*kw, H*W): the convolution is a matmul
    convolved = (weight.reshape(4, -1) @ patches).reshape(2, 4, 7, 6)
    assert torch.allclose(convolved, F.conv2d(x, weight, padding="same", dilation=(2, 1)), atol=1e-5)


def test_the_grad_sampler_paths_are_dptorchs_samplers():
    from dptorch.grad_sample.conv import convolution2d_backward_as_a_convolution
    from dptorch.grad_sample.embedding_norm_sample import compute_embedding_norm_sample
    from dptorch.grad_sample.linear import compute_linear_grad_sample
    from dptorch.grad_sample.layers.registry import find_grad_sampler

    assert compute_linear_grad_sample is find_grad_sampler(nn.Linear(2, 2))
    assert convolution2d_backward_as_a_convolution is find_grad_sampler(nn.Conv2d(1, 1, 1))
    embedding = nn.Embedding(6, 3, padding_idx=0)
    ids, backprops = torch.tensor([[1, 1, 2], [0, 3, 3], [5, 0, 0]]), torch.randn(3, 3, 3)
    instantiated = find_grad_sampler(embedding)(embedding, (ids,), backprops)[embedding.weight]
    norms = compute_embedding_norm_sample(embedding, [ids], backprops)[embedding.weight]
    assert torch.allclose(norms, instantiated.flatten(1).norm(dim=1), atol=1e-6)


# ------------------------------------------------------------------ layers and wrappers


@pytest.mark.parametrize("batch_first", [True, False])
def test_sequence_bias_is_exact_per_sample(batch_first):
    from dptorch.layers import SequenceBias

    torch.manual_seed(2)
    layer = SequenceBias(4, batch_first=batch_first)
    x = torch.randn(3, 5, 4) if batch_first else torch.randn(5, 3, 4)
    out = layer(x)
    assert out.shape == ((3, 6, 4) if batch_first else (6, 3, 4))
    assert torch.equal(out[:, -1] if batch_first else out[-1], layer.bias.expand(3, 4))
    model = nn.Sequential(nn.Linear(4, 4), SequenceBias(4, batch_first=batch_first), nn.Tanh())
    check_per_sample_grads(model, (x,), batch_first=batch_first)


@pytest.mark.parametrize("use_ghost_clipping", [True, False])
def test_fast_gradient_clipping_classes_give_each_samples_norm_and_clip_factor(use_ghost_clipping):
    from dptorch.grad_sample import GradSampleHooksFastGradientClipping, GradSampleModuleFastGradientClipping

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(6, 5) * torch.tensor([0.01, 1, 1, 1, 1])
    reference = reference_per_sample_grads(model, (x,), lambda out: out.pow(2).sum(1))
    want = torch.cat([g.flatten(1) for g in reference.values()], 1).norm(dim=1)
    wrapped = GradSampleModuleFastGradientClipping(model, max_grad_norm=0.5, use_ghost_clipping=use_ghost_clipping,
                                                   loss_reduction="sum")
    assert isinstance(wrapped.hooks, GradSampleHooksFastGradientClipping)
    assert wrapped.hooks.grad_sample_mode == ("ghost" if use_ghost_clipping else "hooks")
    wrapped(x).pow(2).sum().backward()
    assert torch.allclose(wrapped.get_norm_sample(), want.float(), rtol=1e-5)
    assert torch.allclose(wrapped.get_clipping_coef(), (0.5 / want).clamp(max=1).float(), rtol=1e-4)
    assert wrapped.max_grad_norm == 0.5
    wrapped.to_standard_module()
    with pytest.raises(ValueError, match="max_grad_norm"):
        GradSampleHooksFastGradientClipping(model, max_grad_norm=0)


def test_expanded_weights_wrapper_and_the_refused_two_pass_tensor():
    from dptorch.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights
    from dptorch.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    wrapped = GradSampleModuleExpandedWeights(nn.Linear(3, 2))
    assert isinstance(wrapped, GradSampleModule) and wrapped.hooks.grad_sample_mode == "ew"
    wrapped.to_standard_module()
    with pytest.raises(OpacusCompatibilityError, match="one pass"):
        DPTensorFastGradientClipping(None, None, torch.ones(2), loss_reduction="mean")


# ------------------------------------------------------------------ accountants, data, noise


class _Halved(RDPAccountant):
    """An accountant of one's own: RDP's bound, reported as it is."""


def test_register_accountant_feeds_create_accountant_and_the_engine():
    from dptorch.accountants import create_accountant, register_accountant, registry

    assert registry._ACCOUNTANTS is ACCOUNTANTS
    register_accountant("mine", _Halved)
    try:
        assert isinstance(create_accountant("mine"), _Halved)
        with pytest.raises(ValueError, match="already registered"):
            register_accountant("rdp", _Halved)
        register_accountant("mine", RDPAccountant, force=True)
        assert type(create_accountant("mine")) is RDPAccountant
        engine = dptorch.PrivacyEngine(accountant="mine")
        assert type(engine.accountant) is RDPAccountant
        with pytest.raises(TypeError, match="subclass"):
            register_accountant("other", object)
    finally:
        ACCOUNTANTS.pop("mine", None)
    with pytest.raises(ValueError):
        create_accountant("mine")


def test_collate_with_empty_keeps_the_first_batchs_structure():
    from dptorch.data_loader import CollateFnWithEmpty, wrap_collate_with_empty

    collate = wrap_collate_with_empty(collate_fn=default_collate)
    assert collate([]) == []  # nothing known yet
    batch = collate([{"x": torch.ones(2, 3), "y": torch.tensor(1)}, {"x": torch.zeros(2, 3), "y": torch.tensor(0)}])
    assert batch["x"].shape == (2, 2, 3)
    empty = collate([])
    assert empty["x"].shape == (0, 2, 3) and empty["y"].shape == (0,) and empty["y"].dtype == torch.int64
    time_major = CollateFnWithEmpty(default_collate, batch_first=False)
    time_major([torch.ones(4), torch.ones(4)])
    assert time_major([]).shape == (2, 0)
    zeros = CollateFnWithEmpty(default_collate, sample_empty_shapes=[(0, 3)], dtypes=[torch.float64])([])
    assert zeros[0].shape == (0, 3) and zeros[0].dtype == torch.float64
    with pytest.raises(ValueError, match="rand_on_empty"):
        CollateFnWithEmpty(default_collate, rand_on_empty=True)
    strings = CollateFnWithEmpty(lambda samples: "text")
    strings([1])
    with pytest.raises(TypeError, match="Unsupported batch type"):
        strings([])


def test_switch_generator_draws_from_the_new_generator():
    from dptorch.data_loader import DPDataLoader, switch_generator

    dataset = TensorDataset(torch.arange(40.0))
    shuffled = DataLoader(dataset, batch_size=8, shuffle=True)
    first = [b[0] for b in switch_generator(data_loader=shuffled, generator=torch.Generator().manual_seed(5))]
    again = [b[0] for b in DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))]
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and len(first) == 5
    poisson = DPDataLoader(dataset, sample_rate=0.2, generator=torch.Generator().manual_seed(1))
    switched = switch_generator(data_loader=poisson, generator=torch.Generator().manual_seed(7))
    same = DPDataLoader(dataset, sample_rate=0.2, generator=torch.Generator().manual_seed(7))
    assert isinstance(switched, DPDataLoader) and len(switched) == len(poisson)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(switched, same))
    with pytest.raises(ValueError, match="nothing to switch"):
        switch_generator(data_loader=DataLoader(dataset, batch_size=None), generator=torch.Generator())


def test_generate_noise_is_dptorchs_gaussian_noise():
    from dptorch.noise.gaussian import gaussian_noise
    from dptorch.optimizers.optimizer import _generate_noise

    reference = torch.zeros(4000, dtype=torch.float64)
    assert torch.equal(_generate_noise(0.0, reference), reference)
    noise = _generate_noise(2.0, reference, generator=torch.Generator().manual_seed(3))
    assert noise.dtype == torch.float64
    assert torch.equal(noise, gaussian_noise(reference, 2.0, generator=torch.Generator().manual_seed(3)))
    assert abs(float(noise.std()) - 2.0) < 5 * 2.0 / math.sqrt(2 * 4000)  # five standard errors of the std
    assert abs(float(_generate_noise(2.0, reference, secure_mode=True).std()) - 2.0) < 5 * 2.0 / math.sqrt(2 * 4000)
    with pytest.raises(ValueError, match="generator"):
        _generate_noise(1.0, reference, generator=torch.Generator(), secure_mode=True)


def test_an_accountant_written_to_opacus_interface_registers_and_runs():
    from dptorch.accountants import IAccountant, PLDAccountant, create_accountant, register_accountant

    class Counting(IAccountant):  # Opacus' interface: step, get_epsilon, __len__, mechanism
        def __init__(self):
            self.steps = 0

        def step(self, *, noise_multiplier, sample_rate):
            self.steps += 1

        def get_epsilon(self, delta):
            return float(self.steps)

        def __len__(self):
            return self.steps

        def mechanism(cls):
            return "counting"

    assert isinstance(PLDAccountant(), IAccountant) and issubclass(PLDAccountant, IAccountant)
    register_accountant("counting", Counting)
    try:
        accountant = create_accountant("counting")
        accountant.step(noise_multiplier=1.0, sample_rate=0.1)
        assert accountant.get_epsilon(1e-5) == 1.0 and len(accountant) == 1 and accountant.mechanism() == "counting"
    finally:
        ACCOUNTANTS.pop("counting", None)

    class Incomplete(IAccountant):
        pass

    incomplete = Incomplete()
    incomplete.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(NotImplementedError, match="get_epsilon"):
        incomplete.get_epsilon(1e-5)


def test_opacus_accountant_spellings_history_setter_destination_and_mechanism_keyword():
    from dptorch.accountants import create_accountant

    accountant = create_accountant(mechanism="rdp")
    assert isinstance(accountant, RDPAccountant)
    accountant.history = [(1.1, 0.01, 100)]
    same = RDPAccountant()
    same.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=100)
    assert len(accountant) == 100 and accountant.get_epsilon(1e-5) == same.get_epsilon(1e-5)
    with pytest.raises(ValueError):
        accountant.history = [(1.1, 2.0, 100)]  # a sample rate above 1 is refused, as by load_state_dict
    destination = {"kept": 1}
    assert accountant.state_dict(destination) is destination
    assert destination["kept"] == 1 and destination["history"] == [[1.1, 0.01, 100]]
    with pytest.raises(TypeError, match="twice"):
        create_accountant("rdp", mechanism="prv")


def test_make_private_with_adaptive_clipping_returns_opacus_class():
    from dptorch.optimizers.adaclipoptimizer import AdaClipDPOptimizer

    model = nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))), batch_size=8)
    engine = dptorch.PrivacyEngine(accountant="rdp")
    _, optimizer, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          data_loader=loader, noise_multiplier=1.5, max_grad_norm=1.0,
                                          clipping="adaptive", unclipped_num_std=1.0)
    assert isinstance(optimizer, AdaClipDPOptimizer) and optimizer.noise_multiplier == 1.5
    engine.detach()


def test_remove_hooks_detaches_and_an_unsupported_model_is_also_not_implemented():
    from dptorch.grad_sample import GradSampleHooks

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    wrapped = GradSampleModule(model)
    wrapped.remove_hooks()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    hooks = GradSampleHooks(model)
    hooks.remove_hooks()
    assert not hooks.attached and not any(m._forward_hooks for m in model.modules())
    with pytest.raises(NotImplementedError, match="BatchNorm"):
        GradSampleModule(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))


def test_module_validator_fix_takes_opacus_batchnorm_options_and_logs_each_replacement(caplog):
    from dptorch.validators import ModuleValidator

    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm2d(16))
    with caplog.at_level("INFO", logger="dptorch.validate.validator"):
        assert ModuleValidator.fix(model)[1].num_groups == 16
    assert any("Replaced sub_module 1" in record.getMessage() for record in caplog.records)
    assert ModuleValidator.fix(model, num_groups=4)[1].num_groups == 4
    assert isinstance(ModuleValidator.fix(model, replace_bn_with_in=True)[1], nn.InstanceNorm2d)
    with pytest.raises(ValueError, match="divisor of the 16 channels"):
        ModuleValidator.fix(model, num_groups=5)


def test_the_adaptive_clipping_engine_clips_adaptively_in_ghost_mode():
    from dptorch.optimizers import AdaClipDPOptimizer
    from dptorch.utils.adaptive_clipping.adaptive_clipping_utils import PrivacyEngineAdaptiveClipping

    torch.manual_seed(4)
    model = nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))), batch_size=8)
    engine = PrivacyEngineAdaptiveClipping(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
        unclipped_num_std=1.0, min_clipbound=0.1)
    assert isinstance(optimizer, AdaClipDPOptimizer)
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert optimizer.max_grad_norm != 1.0 and len(engine.accountant) == len(loader)
    with pytest.raises(ValueError, match="adaptively"):
        PrivacyEngineAdaptiveClipping().make_private(clipping="flat")


def test_dp_optimizer_takes_opacus_generator_keyword_for_its_noise():
    from dptorch.grad_sample import GradSampleHooks
    from dptorch.optimizers import DPOptimizer

    def noised_step(**keywords):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        with GradSampleHooks(model, loss_reduction="sum"):
            optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0,
                                    max_grad_norm=1.0, expected_batch_size=4, loss_reduction="sum", **keywords)
            model(torch.randn(4, 3)).sum().backward()
            optimizer.step()
        return model.weight.detach().clone()

    seeded = noised_step(generator=torch.Generator().manual_seed(9))
    assert torch.equal(seeded, noised_step(noise_generator=torch.Generator().manual_seed(9)))
    assert not torch.equal(seeded, noised_step(generator=torch.Generator().manual_seed(10)))
    with pytest.raises(TypeError, match="once"):
        noised_step(generator=torch.Generator(), noise_generator=torch.Generator())
