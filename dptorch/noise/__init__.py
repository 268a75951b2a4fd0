"""Noise: DP-SGD's independent Gaussian noise (``gaussian``: torch's replayable generator, or the
OS CSPRNG in secure mode) and, beside it, correlated banded matrix-factorisation noise (``banded``).
"""

from dptorch.noise import gaussian
from dptorch.noise.gaussian import *  # noqa: F403  (the names of gaussian.__all__)

__all__ = list(gaussian.__all__)
