"""Noise: DP-SGD's independent Gaussian noise (``gaussian``: torch's replayable generator, or the
OS CSPRNG in secure mode) and, beside it, correlated banded matrix-factorisation noise (``banded``).
"""

from dptorch.noise.gaussian import (
    NoiseGenerator,
    SecureNoiseGenerator,
    as_noise_generator,
    gaussian_noise,
    noise_dtype,
    secure_bernoulli,
    secure_gaussian,
    secure_gaussian_numpy,
    secure_seed,
    secure_standard_normals,
    secure_uniforms,
)

__all__ = [
    "NoiseGenerator",
    "SecureNoiseGenerator",
    "as_noise_generator",
    "gaussian_noise",
    "noise_dtype",
    "secure_bernoulli",
    "secure_gaussian",
    "secure_gaussian_numpy",
    "secure_seed",
    "secure_standard_normals",
    "secure_uniforms",
]
