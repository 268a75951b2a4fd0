"""Secure float32 noise, as floats: moments, and uniform low-order mantissa bits.

The floating-point argument (dptorch/noise/gaussian.py) says each float32 value gets the mass of
its rounding interval, so within a band of magnitudes the low mantissa bits are uniform. Each
chi-square test fails falsely with probability 1e-6; the moment checks sit at 6 standard
deviations (about 2e-9 each).
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from dptorch.noise import SecureNoiseGenerator, gaussian_noise, secure_summands

DRAWS = 2_000_000
# (lowest |value| / std, highest, low bits tested): the bulk, the tail, and small values
BANDS = [(2.0**-4, 4.0, 8), (2.0, 8.0, 8), (2.0**-12, 2.0**-6, 4)]


def low_bits_pvalues(values: np.ndarray, std: float) -> list:
    magnitudes = np.abs(values.astype(np.float32))
    pvalues = []
    for low, high, bits in BANDS:
        band = magnitudes[(magnitudes >= low * std) & (magnitudes < high * std)]
        assert band.size >= 50 * (1 << bits)  # enough draws for the chi-square approximation
        counts = np.bincount(band.view(np.uint32) & ((1 << bits) - 1), minlength=1 << bits)
        pvalues.append(stats.chisquare(counts).pvalue)
    return pvalues


@pytest.fixture(scope="module")
def noise() -> np.ndarray:
    return gaussian_noise(torch.empty(DRAWS), 0.75, secure=True).numpy()


def test_float32_noise_is_one_draw_with_gaussian_moments(noise):
    assert noise.dtype == np.float32 and secure_summands(torch.float32) == 1 and secure_summands(torch.float64) == 4
    values = noise.astype(np.float64) / 0.75
    assert abs(values.mean()) < 6 / math.sqrt(DRAWS)
    assert abs(values.std() - 1) < 6 / math.sqrt(2 * DRAWS)
    assert abs(np.mean(values**4) - 3) < 6 * math.sqrt(96 / DRAWS)  # var of z^4 is 105 - 9 = 96
    assert np.abs(values).max() < math.sqrt(106 * math.log(2))  # Box-Muller's largest radius


def test_low_order_mantissa_bits_are_uniform(noise):
    assert min(low_bits_pvalues(noise, 0.75)) > 1e-6


def test_the_bit_test_catches_a_coarse_sampler(noise):
    coarse = np.round(noise.astype(np.float64) * 2.0**14) / 2.0**14  # a float support with holes
    assert min(low_bits_pvalues(coarse, 0.75)) < 1e-6


def test_float64_noise_keeps_the_summing_mitigation():
    values = SecureNoiseGenerator().noise_like(torch.empty(500_000, dtype=torch.float64), 2.0)
    assert values.dtype == torch.float64
    assert abs(values.std().item() / 2.0 - 1) < 6 / math.sqrt(2 * 500_000)
    assert stats.kstest(values.numpy()[::5] / 2.0, "norm").pvalue > 1e-6
