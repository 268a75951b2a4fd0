"""The interface every accountant shares: history, state dicts, monotonicity, validation."""

import io
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dptorch.accounting import (
    ACCOUNTANTS,
    Accountant,
    DeltaResolutionWarning,
    accountant_from_state_dict,
    create_accountant,
)

NAMES = list(ACCOUNTANTS)


def make(name: str) -> Accountant:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the GDP warning has its own tests
        return create_accountant(name)


def epsilon(name, sigma, q, steps, delta=1e-5):
    accountant = make(name)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("name", NAMES)
def test_history_is_compressed_into_runs(name):
    accountant = make(name)
    assert accountant.mechanism == name
    for _ in range(1000):
        accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    accountant.step(noise_multiplier=1.2, sample_rate=0.01, num_steps=10**5)
    accountant.step(noise_multiplier=1.2, sample_rate=0.01, num_steps=0)
    assert accountant.history == [[1.0, 0.01, 1000], [1.2, 0.01, 100_000]]
    assert len(accountant) == 101_000


@pytest.mark.parametrize("name", NAMES)
def test_no_steps_means_no_privacy_loss(name):
    assert make(name).get_epsilon(1e-5) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trips_through_torch_weights_only(name):
    accountant = make(name)
    accountant.step(noise_multiplier=1.1, sample_rate=0.02, num_steps=300)
    accountant.step(noise_multiplier=1.5, sample_rate=0.05, num_steps=100)
    buffer = io.BytesIO()
    torch.save({"accountant": accountant.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["accountant"]
    assert state == accountant.state_dict()
    restored = make(name)
    restored.load_state_dict(state)
    assert restored.history == accountant.history
    assert restored.get_epsilon(1e-5) == accountant.get_epsilon(1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert accountant_from_state_dict(state).get_epsilon(1e-5) == accountant.get_epsilon(1e-5)


def test_state_dict_is_plain_python():
    accountant = make("pld")
    accountant.step(noise_multiplier=1, sample_rate=0.5, num_steps=3)
    state = accountant.state_dict()
    assert state == {"mechanism": "pld", "version": 1, "history": [[1.0, 0.5, 3]]}
    assert type(state["history"][0][0]) is float and type(state["history"][0][2]) is int


def test_loading_another_mechanism_is_refused():
    rdp = make("rdp")
    rdp.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match="'rdp' accountant"):
        make("pld").load_state_dict(rdp.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_epsilons_after_is_a_projection(name):
    accountant = make(name)
    accountant.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=100)
    projected = accountant.epsilons_after(noise_multiplier=1.0, sample_rate=0.02, steps=[0, 100], delta=1e-5)
    assert accountant.history == [[1.0, 0.02, 100]]
    assert projected[0] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert projected[1] == pytest.approx(epsilon(name, 1.0, 0.02, 200), rel=1e-9)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    sigma=st.floats(0.8, 3.0),
    q=st.floats(0.005, 0.3),
    steps=st.integers(10, 500),
)
def test_epsilon_grows_with_steps_and_q_and_falls_with_sigma(name, sigma, q, steps):
    base = epsilon(name, sigma, q, steps)
    assert epsilon(name, sigma, q, 2 * steps) >= base
    assert epsilon(name, sigma, min(1.0, 1.5 * q), steps) >= base
    assert epsilon(name, 1.25 * sigma, q, steps) <= base


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "call,message",
    [
        (lambda a: a.step(noise_multiplier=1.0, sample_rate=1.5), r"sample_rate must be in \(0, 1\], got 1.5"),
        (lambda a: a.step(noise_multiplier=1.0, sample_rate=0.0), r"sample_rate must be in \(0, 1\], got 0.0"),
        (lambda a: a.step(noise_multiplier=0.0, sample_rate=0.1), r"noise_multiplier must be a finite number > 0"),
        (lambda a: a.step(noise_multiplier=-1, sample_rate=0.1), r"noise_multiplier .* got -1"),
        (lambda a: a.step(noise_multiplier=1, sample_rate=0.1, num_steps=-3), r"num_steps must be .*>= 0, got -3"),
        (lambda a: a.get_epsilon(0.0), r"delta must be in \(0, 1\), got 0.0"),
        (lambda a: a.get_epsilon(1.0), r"delta must be in \(0, 1\), got 1.0"),
        (lambda a: a.get_epsilon(float("nan")), r"delta must be in \(0, 1\), got nan"),
    ],
)
def test_bad_input_names_the_argument_value_and_range(name, call, message):
    with pytest.raises(ValueError, match=message):
        call(make(name))


def test_large_histories_are_instant_to_record():
    accountant = make("pld")
    for _ in range(10_000):
        accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    assert len(accountant.history) == 1


@pytest.mark.parametrize("name", ["pld", "prv"])
def test_unresolvable_delta_warns_and_gives_infinity(name):
    accountant = make(name)
    accountant.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=1000)
    with pytest.warns(DeltaResolutionWarning, match="'rdp' accountant works for any delta"):
        assert accountant.get_epsilon(1e-16) == float("inf")
    assert epsilon("rdp", 1.0, 0.01, 1000, delta=1e-16) < 10
