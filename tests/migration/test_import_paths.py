"""Every common Opacus 1.6 import path works after renaming ``opacus`` to ``dptorch``.

``OPACUS_PATHS`` is the list the migration guide's table documents (checked below): each path
imports, each name is there and is the dptorch object (or thin adapter) it stands for. Opacus
names without a dptorch counterpart raise ``OpacusCompatibilityError`` naming the replacement.
"""

import importlib
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dptorch
from dptorch import PrivacyEngine
from dptorch.accounting import GDPAccountant, RDPAccountant, create_accountant, get_noise_multiplier
from dptorch.accounting.base import Accountant
from dptorch.data import BatchMemoryManager, DPDataLoader
from dptorch.data.poisson import PoissonBatchSampler
from dptorch.grad_sample import GradSampleHooks, GradSampleModule, register_grad_sampler
from dptorch.grad_sample.layers.registry import find_grad_sampler
from dptorch.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from dptorch.compat.opacus import OpacusCompatibilityError
from dptorch.optim import DPOptimizer
from dptorch.validate import ModuleValidator
from dptorch.validate.fixers import find_module_fixer

# Opacus path -> the names scripts import from it (all must exist under the dptorch path).
OPACUS_PATHS = {
    "opacus": ["PrivacyEngine", "GradSampleModule"],
    "opacus.privacy_engine": ["PrivacyEngine"],
    "opacus.validators": ["ModuleValidator", "register_module_fixer"],
    "opacus.validators.module_validator": ["ModuleValidator"],
    "opacus.utils.batch_memory_manager": ["BatchMemoryManager", "wrap_data_loader"],
    "opacus.utils.uniform_sampler": ["UniformWithReplacementSampler", "DistributedUniformWithReplacementSampler"],
    "opacus.utils.fast_gradient_clipping_utils": ["DPLossFastGradientClipping"],
    "opacus.accountants": ["RDPAccountant", "GaussianAccountant", "PRVAccountant", "IAccountant", "create_accountant"],
    "opacus.accountants.utils": ["get_noise_multiplier"],
    "opacus.accountants.rdp": ["RDPAccountant"],
    "opacus.accountants.analysis.rdp": ["compute_rdp", "get_privacy_spent"],
    "opacus.data_loader": ["DPDataLoader"],
    "opacus.optimizers": [
        "DPOptimizer", "DistributedDPOptimizer", "DPPerLayerOptimizer", "DistributedPerLayerOptimizer",
        "SimpleDistributedPerLayerOptimizer", "DPOptimizerFastGradientClipping",
        "DistributedDPOptimizerFastGradientClipping", "get_optimizer_class",
    ],
    "opacus.optimizers.optimizer": ["DPOptimizer"],
    "opacus.distributed": ["DifferentiallyPrivateDistributedDataParallel"],
    "opacus.grad_sample": ["GradSampleModule", "register_grad_sampler"],
    "opacus.grad_sample.utils": ["wrap_model", "prepare_module", "get_gsm_class", "register_grad_sampler"],
    "opacus.grad_sample.grad_sample_module": ["GradSampleModule", "GradSampleHooks"],
    "opacus.layers": ["DPLSTM", "DPGRU", "DPRNN", "DPMultiheadAttention"],
    "opacus.layers.dp_rnn": ["DPLSTM", "DPGRU", "DPRNN", "DPRNNBase"],
    "opacus.layers.dp_multihead_attention": ["DPMultiheadAttention"],
    "opacus.schedulers": ["ExponentialNoise", "LambdaNoise", "StepNoise", "ExponentialGradClip", "LambdaGradClip",
                          "StepGradClip", "_NoiseScheduler", "_GradClipScheduler"],
    "opacus.schedulers.noise_scheduler": ["ExponentialNoise", "LambdaNoise", "StepNoise", "_NoiseScheduler"],
    "opacus.schedulers.grad_clip_scheduler": ["ExponentialGradClip", "LambdaGradClip", "StepGradClip",
                                              "_GradClipScheduler"],
}

# Paths Opacus' own test suite imports (scripts/opacus_suite.py runs it): each imports with these names.
# The lead merges them into OPACUS_PATHS once the guide's table lists them (docs/migrating-from-opacus.md).
SUITE_PATHS = {
    "opacus.accountants.registry": ["register_accountant", "create_accountant", "_ACCOUNTANTS"],
    "opacus.data_loader": ["CollateFnWithEmpty", "wrap_collate_with_empty", "switch_generator"],
    "opacus.grad_sample": ["GradSampleHooksFastGradientClipping", "GradSampleModuleFastGradientClipping"],
    "opacus.grad_sample.conv": ["compute_conv_grad_sample", "convolution2d_backward_as_a_convolution"],
    "opacus.grad_sample.embedding_norm_sample": ["compute_embedding_norm_sample"],
    "opacus.grad_sample.grad_sample_module_fast_gradient_clipping": ["GradSampleModuleFastGradientClipping"],
    "opacus.grad_sample.gsm_exp_weights": ["GradSampleModuleExpandedWeights"],
    "opacus.grad_sample.linear": ["compute_linear_grad_sample"],
    "opacus.grad_sample.utils": ["GradSampleModuleFastGradientClipping", "GradSampleModuleExpandedWeights"],
    "opacus.layers": ["SequenceBias"],
    "opacus.optimizers.adaclipoptimizer": ["AdaClipDPOptimizer"],
    "opacus.optimizers.ddp_perlayeroptimizer": ["DistributedPerLayerOptimizer", "SimpleDistributedPerLayerOptimizer"],
    "opacus.optimizers.ddpoptimizer": ["DistributedDPOptimizer"],
    "opacus.optimizers.ddpoptimizer_fast_gradient_clipping": ["DistributedDPOptimizerFastGradientClipping"],
    "opacus.optimizers.optimizer": ["_generate_noise"],
    "opacus.optimizers.optimizer_fast_gradient_clipping": ["DPOptimizerFastGradientClipping"],
    "opacus.optimizers.perlayeroptimizer": ["DPPerLayerOptimizer"],
    "opacus.utils.fast_gradient_clipping_utils": ["DPTensorFastGradientClipping"],
    "opacus.utils.module_utils": ["are_state_dict_equal", "trainable_parameters", "clone_module"],
    "opacus.utils.packed_sequences": ["compute_seq_lengths"],
    "opacus.utils.per_sample_gradients_utils": [
        "check_per_sample_gradients_are_correct", "compute_grad_samples_microbatch_and_opacus",
        "compute_opacus_grad_sample", "get_grad_sample_modes", "is_batch_empty", "clone_module",
    ],
    "opacus.utils.tensor_utils": ["unfold2d"],
    "opacus.utils.adaptive_clipping.adaptive_clipping_utils": ["PrivacyEngineAdaptiveClipping"],
    "opacus.validators.errors": ["IllegalModuleConfigurationError", "ShouldReplaceModuleError", "UnsupportedModuleError"],
    "opacus.accountants": ["register_accountant", "registry"],
}

# Opacus paths dptorch does not provide (the guide names the replacement of each).
NOT_PROVIDED = ["opacus.scripts.compute_dp_sgd_privacy", "opacus.lightning"]

# Opacus names, inside provided paths, that raise OpacusCompatibilityError naming the replacement.
UNMAPPED_NAMES = {
    "opacus.optimizers": {"FSDPOptimizerFastGradientClipping": "'bk'"},
    "opacus.layers.dp_rnn": {"DPLSTMCell": "DPLSTM", "DPGRUCell": "DPGRU", "DPRNNCell": "DPRNN"},
    "opacus.grad_sample.utils": {"register_norm_sampler": "NormSampler"},
    "opacus.validators": {"register_module_validator": "register_module_check"},
}

# Names that are the dptorch object itself (not an adapter).
SAME_OBJECT = {
    "PrivacyEngine": PrivacyEngine,
    "GradSampleModule": GradSampleModule,
    "GradSampleHooks": GradSampleHooks,
    "ModuleValidator": ModuleValidator,
    "BatchMemoryManager": BatchMemoryManager,
    "UniformWithReplacementSampler": PoissonBatchSampler,
    "RDPAccountant": RDPAccountant,
    "GaussianAccountant": GDPAccountant,
    "create_accountant": create_accountant,
    "get_noise_multiplier": get_noise_multiplier,
    "DPDataLoader": DPDataLoader,
    "DPOptimizer": DPOptimizer,
    "DistributedDPOptimizer": DPOptimizer,
    "DPOptimizerFastGradientClipping": DPOptimizer,
    "DistributedDPOptimizerFastGradientClipping": DPOptimizer,
    "DifferentiallyPrivateDistributedDataParallel": nn.parallel.DistributedDataParallel,
    "register_grad_sampler": register_grad_sampler,
    "DPLSTM": DPLSTM,
    "DPGRU": DPGRU,
    "DPRNN": DPRNN,
    "DPMultiheadAttention": DPMultiheadAttention,
}


def dptorch_path(opacus_path):
    return "dptorch" + opacus_path[len("opacus"):]


def test_the_list_covers_the_paths_the_brief_names():
    assert len(OPACUS_PATHS) == 24
    for path in ["opacus.validators", "opacus.utils.batch_memory_manager", "opacus.accountants.utils",
                 "opacus.data_loader", "opacus.optimizers", "opacus.utils.uniform_sampler", "opacus.distributed",
                 "opacus.grad_sample.utils", "opacus.layers", "opacus.privacy_engine"]:
        assert path in OPACUS_PATHS


@pytest.mark.parametrize("opacus_path", sorted(OPACUS_PATHS))
def test_opacus_path_imports_under_dptorch_with_its_names(opacus_path):
    module = importlib.import_module(dptorch_path(opacus_path))
    for name in OPACUS_PATHS[opacus_path]:
        value = getattr(module, name)
        if name in SAME_OBJECT:
            assert value is SAME_OBJECT[name], f"{dptorch_path(opacus_path)}.{name}"
        assert name in getattr(module, "__all__", dir(module))


@pytest.mark.parametrize("opacus_path", sorted(SUITE_PATHS))
def test_the_paths_of_opacus_test_suite_import_with_their_names(opacus_path):
    module = importlib.import_module(dptorch_path(opacus_path))
    assert module is importlib.import_module(dptorch_path(opacus_path))
    for name in SUITE_PATHS[opacus_path]:
        assert hasattr(module, name), f"{dptorch_path(opacus_path)}.{name}"


@pytest.mark.parametrize("opacus_path", sorted(UNMAPPED_NAMES))
def test_opacus_only_names_raise_a_clear_error_naming_the_replacement(opacus_path):
    module_name = dptorch_path(opacus_path)
    module = importlib.import_module(module_name)
    for name, replacement in UNMAPPED_NAMES[opacus_path].items():
        with pytest.raises(OpacusCompatibilityError) as caught:
            exec(f"from {module_name} import {name}", {})
        message = str(caught.value)
        assert f"{opacus_path}.{name}" in message and replacement in message
        assert isinstance(caught.value, ImportError) and isinstance(caught.value, NotImplementedError)
    assert not hasattr(module, "no_such_name_anywhere")  # other names: a plain AttributeError


def test_the_migration_guide_lists_every_path_with_its_status():
    guide = (Path(__file__).resolve().parents[2] / "docs" / "migrating-from-opacus.md").read_text()
    rows = dict(re.findall(r"^\| `(opacus[\w.]*)` \| (.+) \|$", guide, flags=re.MULTILINE))
    for opacus_path in set(OPACUS_PATHS) | set(SUITE_PATHS):
        assert opacus_path in rows, opacus_path
        assert f"`{dptorch_path(opacus_path)}`" in rows[opacus_path]
    for opacus_path in NOT_PROVIDED:
        assert opacus_path in rows and "not provided" in rows[opacus_path]
        with pytest.raises(ImportError):
            importlib.import_module(dptorch_path(opacus_path))
    assert set(rows) == set(OPACUS_PATHS) | set(SUITE_PATHS) | set(NOT_PROVIDED)
    assert f"\n{len(set(OPACUS_PATHS) | set(SUITE_PATHS))} paths work" in guide  # the count under the table


# ------------------------------------------------------------------------------ the adapters


def test_compute_rdp_and_get_privacy_spent_agree_with_the_rdp_accountant():
    from dptorch.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.1, sample_rate=0.004, num_steps=2500)
    orders = list(accountant.orders)
    rdp = compute_rdp(q=0.004, noise_multiplier=1.1, steps=2500, orders=orders)
    epsilon, best_alpha = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert (epsilon, best_alpha) == accountant.get_privacy_spent(delta=1e-5)
    assert compute_rdp(q=0.004, noise_multiplier=1.1, steps=2500, orders=8) == pytest.approx(rdp[orders.index(8)])
    with pytest.raises(ValueError, match="same length"):
        get_privacy_spent(orders=[2, 3], rdp=[0.1], delta=1e-5)


def test_uniform_with_replacement_sampler_takes_opacus_keywords():
    from dptorch.utils.uniform_sampler import UniformWithReplacementSampler

    sampler = UniformWithReplacementSampler(
        num_samples=1000, sample_rate=0.05, generator=torch.Generator().manual_seed(0)
    )
    batches = list(sampler)
    assert len(sampler) == len(batches) == 20
    sizes = [len(b) for b in batches]
    assert 30 < sum(sizes) / len(sizes) < 70 and len(set(sizes)) > 1  # Binomial(1000, 0.05) sizes
    assert all(0 <= i < 1000 for b in batches for i in b)
    assert len(UniformWithReplacementSampler(num_samples=10, sample_rate=0.5, steps=3)) == 3


class _SignalRecorder:
    def __init__(self):
        self.signals = []

    def signal_skip_step(self, do_skip=True):
        self.signals.append(do_skip)


def test_wrap_data_loader_splits_logical_batches_and_signals_the_optimizer():
    from dptorch.utils.batch_memory_manager import wrap_data_loader

    dataset = TensorDataset(torch.arange(400.0).unsqueeze(1))
    loader = DPDataLoader(dataset, sample_rate=0.25, generator=torch.Generator().manual_seed(0))
    optimizer = _SignalRecorder()
    physical = list(wrap_data_loader(data_loader=loader, max_batch_size=32, optimizer=optimizer))
    assert all(len(batch[0]) <= 32 for batch in physical)
    assert len(optimizer.signals) == len(physical) > len(loader)
    assert optimizer.signals.count(False) == len(loader) == 4  # one real step per logical batch
    assert sum(len(batch[0]) for batch in physical) > 0


def test_get_optimizer_class_maps_clipping_modes_and_refuses_opacus_only_ones():
    from dptorch.optimizers import DPPerLayerOptimizer, get_optimizer_class

    assert get_optimizer_class("flat", distributed=False) is DPOptimizer
    assert get_optimizer_class("flat", distributed=True, grad_sample_mode="ghost") is DPOptimizer
    assert get_optimizer_class("per_layer", distributed=True, grad_sample_mode="hooks") is DPPerLayerOptimizer
    from dptorch.optim import AdaClipDPOptimizer
    from dptorch.optimizers import AdaClipDPOptimizer as opacus_name

    assert get_optimizer_class("adaptive", distributed=False) is AdaClipDPOptimizer is opacus_name
    with pytest.raises(OpacusCompatibilityError, match="FSDP"):
        get_optimizer_class("flat", distributed=True, grad_sample_mode="ghost_fsdp")
    with pytest.raises(ValueError, match="clipping"):
        get_optimizer_class("automatic", distributed=False)


def test_per_layer_optimizer_clips_per_layer_by_default():
    from dptorch.optimizers import DPPerLayerOptimizer

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with GradSampleHooks(model) as hooks:
        optimizer = DPPerLayerOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=1.0,
            max_grad_norm=[1.0, 0.5, 1.0, 0.5], expected_batch_size=8,
        )
        assert optimizer.clipping == "per_layer" and isinstance(optimizer, DPOptimizer)
        optimizer.detach()


def test_wrap_model_wraps_or_attaches_to_the_untouched_model():
    from dptorch.grad_sample.utils import get_gsm_class, prepare_module, wrap_model

    model = nn.Sequential(nn.Linear(3, 2))
    wrapped = wrap_model(model, grad_sample_mode="hooks")
    assert isinstance(wrapped, GradSampleModule) and wrapped._module is model
    assert wrapped.to_standard_module() is model

    hooks = wrap_model(model, "hooks", wrap_model=False, loss_reduction="sum")
    assert isinstance(hooks, GradSampleHooks) and hooks.module is model and hooks.loss_reduction == "sum"
    model(torch.randn(5, 3)).sum().backward()
    assert model[0].weight.grad_sample.shape == (5, 2, 3)
    hooks.cleanup()
    assert not hasattr(model[0].weight, "grad_sample")

    hooks = prepare_module(model, "hooks", attach_only=True, force_functorch=True)
    assert isinstance(hooks, GradSampleHooks) and hooks.grad_sample_mode == "functorch"
    hooks.cleanup()
    assert get_gsm_class("ghost") is GradSampleModule
    with pytest.raises(OpacusCompatibilityError, match="no_op"):
        wrap_model(model, "no_op")
    with pytest.raises(OpacusCompatibilityError, match="FSDP"):
        get_gsm_class("ghost_fsdp")


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.scale


class _Shifted(_Scaled):
    pass


def test_register_grad_sampler_and_fixer_accept_a_list_of_types_as_in_opacus():
    from dptorch.grad_sample.utils import register_grad_sampler as opacus_register
    from dptorch.validators import register_module_fixer

    def scale_sampler(module, activations, backprops):
        return {module.scale: activations[0] * backprops}

    def fixer(module):
        return module

    opacus_register([_Scaled, _Shifted])(scale_sampler)
    register_module_fixer([_Scaled, _Shifted])(fixer)
    assert find_grad_sampler(_Scaled()) is scale_sampler and find_grad_sampler(_Shifted()) is scale_sampler
    assert find_module_fixer(_Scaled()) is fixer and find_module_fixer(_Shifted()) is fixer


def _ghost_setup(wrap_model):
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(64, 5), torch.randint(0, 2, (64,)))
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=torch.utils.data.DataLoader(dataset, batch_size=16),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost", wrap_model=wrap_model,
    )
    # wrap_model=True: the GradSampleModule, called in place of the model; False: the controller, the model untouched
    return engine, (private if wrap_model else model), private, optimizer, loader


@pytest.mark.parametrize("wrap_model", [True, False])
def test_dp_loss_fast_gradient_clipping_takes_opacus_arguments(wrap_model):
    from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    engine, model, private, optimizer, loader = _ghost_setup(wrap_model)
    criterion = DPLossFastGradientClipping(private, optimizer, nn.CrossEntropyLoss(), loss_reduction="mean")
    assert criterion.hooks is engine.hooks
    before = [p.detach().clone() for p in optimizer.params]
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert len(engine.accountant) == len(loader) == 4
    assert all(not torch.equal(a, b) for a, b in zip(before, optimizer.params))
    engine.detach()
    with pytest.raises(TypeError, match="controller"):
        DPLossFastGradientClipping(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1), nn.MSELoss())


def test_package_root_still_exports_the_opacus_top_level_names():
    assert dptorch.PrivacyEngine is PrivacyEngine and dptorch.GradSampleModule is GradSampleModule
