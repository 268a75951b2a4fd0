"""Static-shape batch selections are accounted by the event their sampling deserves, checked against dp_accounting.

Truncated Poisson: dp_accounting's TruncatedSubsampledGaussianDpEvent (add-or-remove-one), 'pld' only.
Fixed size: SampledWithoutReplacementDpEvent of a Gaussian of sigma / 2 (replace-one, sensitivity 2C), 'rdp' only.
"""

import io
import math

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant

from dptorch.accounting import Selection, accountant_from_state_dict, create_accountant, get_noise_multiplier
from dptorch.accounting.pld import automatic_discretization_interval
from dptorch.accounting.sampled_gaussian_rdp import DEFAULT_ORDERS

N, B, Q = 1000, 70, 0.05  # expected batch 50; at most 70 kept
TRUNCATED = Selection("truncated_poisson", N, B)
FIXED = Selection("fixed_size", N, 50)
DELTA = 1e-5


def accountant(name, selection, sigma, q, steps, **options):
    acc = create_accountant(name, **options)
    acc.use_selection(selection)
    acc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return acc


def truncated_reference(sigma, steps, interval, batch=B):
    reference = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    reference.compose(dp_event.TruncatedSubsampledGaussianDpEvent(
        dataset_size=N, sampling_probability=Q, truncated_batch_size=batch, noise_multiplier=sigma), steps)
    return reference.get_epsilon(DELTA)


def fixed_size_reference(sigma, steps, size=50):
    reference = rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS), NeighboringRelation.REPLACE_ONE)
    event = dp_event.SampledWithoutReplacementDpEvent(N, size, dp_event.GaussianDpEvent(sigma / 2))  # 2C
    reference.compose(event, steps)
    return reference.get_epsilon(DELTA)


@pytest.mark.parametrize("sigma,steps", [(1.0, 40), (0.8, 120)])
def test_truncated_poisson_epsilon_is_dp_accountings_event_epsilon(sigma, steps):
    ours = accountant("pld", TRUNCATED, sigma, Q, steps)
    interval = automatic_discretization_interval(((sigma, Q, steps),))
    assert ours.get_epsilon(DELTA) == pytest.approx(truncated_reference(sigma, steps, interval), rel=1e-7)
    poisson = accountant("pld", Selection(), sigma, Q, steps)
    assert ours.get_epsilon(DELTA) > poisson.get_epsilon(DELTA)  # truncation is not free: a sample may replace another


def test_truncation_that_can_never_happen_costs_nothing():
    ours = accountant("pld", Selection("truncated_poisson", N, N), 1.0, Q, 40)  # B = N: never truncated
    assert ours.get_epsilon(DELTA) == accountant("pld", Selection(), 1.0, Q, 40).get_epsilon(DELTA)


def test_fixed_size_epsilon_is_dp_accountings_replace_one_event_epsilon_at_half_the_noise():
    ours = accountant("rdp", FIXED, 1.5, 50 / N, 100)
    assert ours.get_epsilon(DELTA) == pytest.approx(fixed_size_reference(1.5, 100), rel=1e-12)
    assert ours.get_rdp().shape == (len(DEFAULT_ORDERS),)


@pytest.mark.filterwarnings("ignore::dptorch.accounting.GDPApproximationWarning")
@pytest.mark.parametrize("name", ["rdp", "prv", "gdp"])
def test_accountants_without_the_truncated_event_refuse_it_and_name_the_one_that_has_it(name):
    with pytest.raises(ValueError, match="accounted by the 'pld' accountant"):
        create_accountant(name).use_selection(TRUNCATED)


@pytest.mark.filterwarnings("ignore::dptorch.accounting.GDPApproximationWarning")
@pytest.mark.parametrize("name", ["pld", "prv", "gdp"])
def test_accountants_without_sampling_without_replacement_refuse_it(name):
    with pytest.raises(ValueError, match="accounted by the 'rdp' accountant"):
        create_accountant(name).use_selection(FIXED)


def test_a_fixed_size_step_is_recorded_only_at_its_own_rate():
    acc = create_accountant("rdp")
    acc.use_selection(FIXED)
    with pytest.raises(ValueError, match="samples at rate 0.05"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1)


def test_steps_of_one_selection_do_not_mix_with_another():
    acc = accountant("pld", TRUNCATED, 1.0, Q, 3)
    with pytest.raises(ValueError, match="one accountant composes one selection"):
        acc.use_selection(Selection())


def test_the_selection_travels_with_the_accountant_state():
    acc = accountant("pld", TRUNCATED, 1.0, Q, 30)
    buffer = io.BytesIO()
    torch.save(acc.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    restored = accountant_from_state_dict(state)
    assert restored.selection == TRUNCATED
    assert restored.get_epsilon(DELTA) == acc.get_epsilon(DELTA)
    assert "selection" not in create_accountant("pld").state_dict()  # a Poisson state is as before (Opacus reads it)
    with pytest.raises(ValueError, match="accounted by the 'pld' accountant"):
        create_accountant("rdp").load_state_dict({**state, "mechanism": "rdp"})


def test_calibration_meets_the_truncated_event_and_no_less_noise_does():
    sigma = get_noise_multiplier(target_epsilon=2.0, target_delta=DELTA, sample_rate=Q, steps=50, selection=TRUNCATED)
    interval = automatic_discretization_interval(((sigma, Q, 50),))
    assert truncated_reference(sigma, 50, interval) <= 2.0
    lower = sigma * (1 - 2e-3)
    assert truncated_reference(lower, 50, automatic_discretization_interval(((lower, Q, 50),))) > 2.0
    assert sigma > get_noise_multiplier(target_epsilon=2.0, target_delta=DELTA, sample_rate=Q, steps=50)


def test_calibration_of_the_truncated_event_needs_an_accountant_that_has_it():
    with pytest.raises(ValueError, match="accounted by the 'pld' accountant"):
        get_noise_multiplier(target_epsilon=2.0, target_delta=DELTA, sample_rate=Q, steps=50, selection=TRUNCATED,
                             accountant="rdp")


def test_selection_refuses_what_it_cannot_describe():
    with pytest.raises(ValueError, match="larger than the 1000 units"):
        Selection("fixed_size", N, N + 1)
    with pytest.raises(ValueError, match="batch selection is one of"):
        Selection("balls_in_bins", N, 10)
    assert Selection().adjacency == "add or remove one unit" and FIXED.adjacency == "replace one unit"
    assert math.isclose(FIXED.check_sample_rate(0.05), 0.05)
