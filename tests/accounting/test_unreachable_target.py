"""An unreachable target epsilon is refused with what reaches it: fewer steps or a smaller sample
rate, each figure computed by the accountant (issue 31)."""

import re

import pytest

from dptorch.accounting import calibration, create_accountant, get_noise_multiplier

TARGET, DELTA, Q, STEPS = 0.001, 1e-5, 0.1, 5_000


def _epsilon(sigma, q, steps):
    accountant = create_accountant("pld")
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_epsilon(DELTA)


def test_the_refusal_names_the_steps_and_the_sample_rate_that_reach_the_target(monkeypatch):
    calls = []
    advice = calibration._unreachable_message

    def counted(epsilon_at, *rest):
        return advice(lambda *a: calls.append(a) or epsilon_at(*a), *rest)

    monkeypatch.setattr(calibration, "_unreachable_message", counted)
    with pytest.raises(ValueError) as refusal:
        get_noise_multiplier(target_epsilon=TARGET, target_delta=DELTA, sample_rate=Q, steps=STEPS)
    message = str(refusal.value)
    assert message.startswith(f"target_epsilon=0.001 is unreachable: even noise_multiplier=10000 gives epsilon")
    steps = int(re.search(r"at most ([\d,]+) steps", message).group(1).replace(",", ""))
    rate = float(re.search(r"a sample rate of at most ([\d.e-]+) at these steps", message).group(1))
    assert "data set" in message and "larger target_epsilon" in message
    sigma = calibration.MAX_NOISE_MULTIPLIER
    assert 1 <= steps < STEPS and _epsilon(sigma, Q, steps) <= TARGET  # each figure reaches the target
    assert 0 < rate < Q and _epsilon(sigma, rate, STEPS) <= TARGET
    assert _epsilon(sigma, Q, int(steps * 1.05)) > TARGET  # and is within a few percent of the largest
    assert _epsilon(sigma, rate * 1.05, STEPS) > TARGET
    assert len(calls) <= 2 * calibration.ADVICE_CALLS + 2  # a bounded number of accountant calls


def test_an_accountant_with_a_floor_says_so():
    # RDP's conversion has a floor (about 0.02 at delta 1e-5 over its orders): fewer steps do not help
    def rdp_epsilon(sigma, q, steps):
        accountant = create_accountant("rdp")
        accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        return accountant.get_epsilon(DELTA)

    reached = rdp_epsilon(calibration.MAX_NOISE_MULTIPLIER, 0.01, 10)
    message = calibration._unreachable_message(rdp_epsilon, reached, TARGET, DELTA, 0.01, 10, "rdp")
    assert "no fewer steps or smaller sample rate reaches it (the 'pld' accountant may" in message
