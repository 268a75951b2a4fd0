"""The GDP central-limit approximation may report epsilon but never chooses the noise: a sigma it
calls epsilon 1.0 has a true (PLD) epsilon of 3.7 at q 0.001 over 1000 steps."""

import math
import warnings

import pytest
import torch
from scipy.optimize import brentq
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.accounting import create_accountant, get_noise_multiplier
from dptorch.accounting.gdp import clt_mu, gdp_epsilon
from tests.helpers import snapshot

GDP_REFUSAL = r"accountant='gdp' cannot calibrate the noise: .* Calibrate with 'pld'"


def gdp_calibrated_sigma(target, delta, q, steps):
    """What a GDP-based calibration returns: the sigma whose CLT epsilon is exactly the target."""
    gap = lambda log_sigma: gdp_epsilon(clt_mu(((math.exp(log_sigma), q, steps),)), delta) - target  # noqa: E731
    return math.exp(brentq(gap, math.log(0.05), math.log(100.0), xtol=1e-9))


def test_a_gdp_calibrated_sigma_spends_several_times_the_target():
    sigma = gdp_calibrated_sigma(1.0, 1e-5, 0.001, 1000)
    pld = create_accountant("pld")
    pld.step(noise_multiplier=sigma, sample_rate=0.001, num_steps=1000)
    assert pld.get_epsilon(1e-5) > 3.5  # measured 3.69 against the target 1.0


def test_calibration_refuses_gdp_and_the_bounds_meet_the_target():
    with pytest.raises(ValueError, match=GDP_REFUSAL):
        get_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.001, steps=1000, accountant="gdp")
    sigma = get_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.001, steps=1000)
    pld = create_accountant("pld")
    pld.step(noise_multiplier=sigma, sample_rate=0.001, num_steps=1000)
    assert 0.99 <= pld.get_epsilon(1e-5) <= 1.0


def test_engine_with_gdp_refuses_make_private_with_epsilon_before_attaching_but_still_reports():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    loader = DataLoader(TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))), batch_size=8)
    before = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GDPAccountant warns that it is an approximation
        engine = PrivacyEngine(accountant="gdp")
    with pytest.raises(ValueError, match=GDP_REFUSAL):
        engine.make_private_with_epsilon(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         data_loader=loader, target_epsilon=2.0, target_delta=1e-5, epochs=1,
                                         max_grad_norm=1.0, wrap_model=False)
    assert snapshot(model) == before and engine.hooks is None
    _hooks, opt, dl = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
    x, y = next(iter(dl))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    report = engine.privacy_report(1e-5)
    assert report["accountant"] == "gdp" and "approximation" in report["note"] and report["epsilon"] > 0


def test_trainer_arguments_refuse_gdp_with_a_target_epsilon():
    pytest.importorskip("transformers")
    from dptorch.integrations.hf import PrivacyArguments

    with pytest.raises(ValueError, match=GDP_REFUSAL):
        PrivacyArguments(target_epsilon=3.0, accountant="gdp")
    assert PrivacyArguments(noise_multiplier=1.0, accountant="gdp").accountant == "gdp"
