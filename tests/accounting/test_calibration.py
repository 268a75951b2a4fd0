"""get_noise_multiplier: never overshoots, within its tolerance, with clear errors."""

import warnings

import pytest

from dptorch.accounting import create_accountant, get_noise_multiplier, steps_for_epochs


def epsilon(name, sigma, q, steps, delta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accountant = create_accountant(name)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(
    "name,target,q,steps",
    [
        ("pld", 8.0, 0.04, 2250),
        ("pld", 1.0, 0.01, 10_000),
        ("pld", 20.0, 1.0, 10),
        ("rdp", 3.0, 0.004, 20_000),
        ("prv", 2.0, 0.02, 500),
    ],
)
def test_round_trip(name, target, q, steps):
    tolerance = 1e-3  # the default: epsilon within 0.1% below the target, never above
    sigma = get_noise_multiplier(
        target_epsilon=target, target_delta=1e-5, sample_rate=q, steps=steps, accountant=name
    )
    reached = epsilon(name, sigma, q, steps, 1e-5)
    assert target * (1 - tolerance) <= reached <= target
    assert epsilon(name, sigma * (1 - tolerance), q, steps, 1e-5) > target


def test_tighter_accountant_needs_less_noise():
    kwargs = dict(target_epsilon=4.0, target_delta=1e-5, sample_rate=0.01, steps=5000)
    assert get_noise_multiplier(**kwargs) < get_noise_multiplier(**kwargs, accountant="rdp")


def test_epochs_are_converted_to_steps():
    assert steps_for_epochs(3, 0.03) == 100
    assert steps_for_epochs(1, 0.3) == 4
    by_epochs = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.03, epochs=3)
    by_steps = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.03, steps=100)
    assert by_epochs == by_steps


def test_smaller_tolerance_gets_closer():
    kwargs = dict(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.05, steps=400, accountant="rdp")
    sigma = get_noise_multiplier(**kwargs, epsilon_tolerance=1e-4)
    assert 2.0 * (1 - 1e-4) <= epsilon("rdp", sigma, 0.05, 400, 1e-5) <= 2.0


def test_unreachable_target_is_a_clear_error():
    with pytest.raises(ValueError, match="unreachable"):
        get_noise_multiplier(target_epsilon=1e-9, target_delta=1e-5, sample_rate=1.0, steps=10_000, accountant="rdp")


def test_unresolvable_delta_says_so():
    with pytest.raises(ValueError, match="delta is below what this accountant resolves"):
        get_noise_multiplier(target_epsilon=5, target_delta=1e-16, sample_rate=0.5, steps=10)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(target_epsilon=0), r"target_epsilon must be a finite number > 0, got 0"),
        (dict(target_delta=1), r"target_delta must be in \(0, 1\), got 1"),
        (dict(sample_rate=2), r"sample_rate must be in \(0, 1\], got 2"),
        (dict(steps=-1), r"steps must be a whole number >= 0, got -1"),
        (dict(steps=None), r"exactly one of epochs and steps"),
        (dict(epochs=1), r"exactly one of epochs and steps"),
        (dict(accountant="moments"), r"accountant must be one of 'pld', 'prv', 'rdp', 'gdp', got 'moments'"),
        (dict(epsilon_tolerance=1.5), r"epsilon_tolerance must be in \(0, 1\)"),
    ],
)
def test_bad_input(kwargs, message):
    arguments = dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=100)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        get_noise_multiplier(**arguments)
