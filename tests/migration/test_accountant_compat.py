"""Opacus' accountant interface on dptorch's accountants: ``mechanism()`` and ``get_optimizer_hook_fn``.

Both spellings of the mechanism work (dptorch's attribute, Opacus' call) and it still serialises
as a plain string; the optimizer hook records each step the way Opacus' manual (engine-less) flow
expects.
"""

import io
import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dptorch.accountants import GaussianAccountant, PRVAccountant, RDPAccountant, create_accountant
from dptorch.accounting import ACCOUNTANTS, PLDAccountant, accountant_from_state_dict
from dptorch.accounting.gdp import GDPApproximationWarning
from dptorch.data_loader import DPDataLoader
from dptorch.grad_sample import GradSampleModule
from dptorch.optimizers import DPOptimizer

pytestmark = pytest.mark.filterwarnings("ignore::dptorch.accounting.gdp.GDPApproximationWarning")


@pytest.mark.parametrize("name", sorted(ACCOUNTANTS))
def test_mechanism_is_an_attribute_and_a_call(name):
    cls = ACCOUNTANTS[name]
    accountant = create_accountant(name)
    assert accountant.mechanism == name and cls.mechanism == name  # dptorch's spelling
    assert accountant.mechanism() == name and cls.mechanism() == name  # Opacus' classmethod spelling
    assert type(accountant.mechanism()) is str
    assert f"{accountant.mechanism}" == name and {name: 1}[accountant.mechanism] == 1


@pytest.mark.parametrize("name", sorted(ACCOUNTANTS))
def test_state_dict_with_the_callable_mechanism_still_loads_with_weights_only(name):
    accountant = create_accountant(name)
    accountant.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=5)
    state = accountant.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # a str subclass would be refused here
    assert type(loaded["mechanism"]) is str and loaded["mechanism"] == name
    assert json.loads(json.dumps(state))["mechanism"] == name
    restored = accountant_from_state_dict(loaded)
    assert type(restored) is type(accountant) and restored.history == [[1.0, 0.01, 5]]


def test_opacus_class_names_are_the_dptorch_accountants():
    assert GaussianAccountant.mechanism() == "gdp"
    assert PRVAccountant.mechanism() == "prv" and RDPAccountant.mechanism() == "rdp"
    with pytest.warns(GDPApproximationWarning):
        assert isinstance(GaussianAccountant(), ACCOUNTANTS["gdp"])


def test_rdp_get_privacy_spent_is_epsilon_and_best_order():
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=1000)
    epsilon, best_alpha = accountant.get_privacy_spent(delta=1e-5)
    assert epsilon == accountant.get_epsilon(1e-5)
    assert best_alpha in accountant.orders
    assert 1 < best_alpha < max(accountant.orders)


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.1])
def test_hook_refuses_an_invalid_sample_rate(bad):
    with pytest.raises(ValueError, match="sample_rate"):
        RDPAccountant().get_optimizer_hook_fn(sample_rate=bad)


class _Optimizer:
    """The two attributes Opacus' hook reads."""

    def __init__(self, noise_multiplier, accumulated_iterations=None):
        self.noise_multiplier = noise_multiplier
        if accumulated_iterations is not None:
            self.accumulated_iterations = accumulated_iterations


def test_hook_records_the_current_noise_and_scales_the_rate_by_accumulated_iterations():
    accountant = PLDAccountant()
    hook = accountant.get_optimizer_hook_fn(sample_rate=0.02)
    hook(_Optimizer(1.0))
    hook(_Optimizer(1.0))
    hook(_Optimizer(2.0, accumulated_iterations=3))  # Opacus: q times the accumulated batches
    assert accountant.history == [[1.0, 0.02, 2], [2.0, 0.06, 1]]


def test_opacus_manual_flow_with_the_optimizer_hook_accounts_every_step():
    """GradSampleModule + DPOptimizer + DPDataLoader + accountant hook, without PrivacyEngine."""
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(200, 6), torch.randint(0, 3, (200,)))
    sample_rate = 0.1
    model = GradSampleModule(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        hooks=model.hooks,  # dptorch's one addition: the optimizer reads the controller
        noise_multiplier=1.3,
        max_grad_norm=1.0,
        expected_batch_size=sample_rate * len(dataset),
    )
    accountant = RDPAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    loader = DPDataLoader(dataset, sample_rate=sample_rate)
    before = [p.detach().clone() for p in model.parameters()]
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps += 1
    optimizer.noise_multiplier = 2.0
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps += 1
    model.to_standard_module()

    assert steps == 2 * len(loader) == 20
    assert accountant.history == [[1.3, sample_rate, 10], [2.0, sample_rate, 10]]
    reference = RDPAccountant()
    reference.step(noise_multiplier=1.3, sample_rate=sample_rate, num_steps=10)
    reference.step(noise_multiplier=2.0, sample_rate=sample_rate, num_steps=10)
    assert accountant.get_epsilon(1e-5) == reference.get_epsilon(1e-5)
    assert math.isfinite(accountant.get_epsilon(1e-5)) and accountant.get_epsilon(1e-5) > 0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
