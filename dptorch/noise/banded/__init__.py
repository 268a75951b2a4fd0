"""Noise mechanisms beside DP-SGD's independent Gaussian: banded matrix factorisation (DP-BandMF).

* :mod:`~dptorch.noise.banded.toeplitz`: the b-banded Toeplitz strategy C (``BandedToeplitz``).
* :mod:`~dptorch.noise.banded.optimize`: the band minimising the prefix-sum error (or that of
  ``SGDWorkload``: momentum, learning-rate schedule), cached by (n, b, workload).
* :mod:`~dptorch.noise.banded.choose`: ``choose_bands``, the b with the lowest expected error at
  a target epsilon (b = 1, DP-SGD, unless a banded strategy is lower).
* :mod:`~dptorch.noise.banded.streaming`: ``BandedNoise``, ``C^{-1} z`` step by step, O(b) state.
* :mod:`~dptorch.noise.banded.accounting`: the amplification theorem's reduction to DP-SGD.

The sampling the theorem needs is :class:`dptorch.data.cyclic_poisson.CyclicPoissonBatchSampler`
(loaders for it: :mod:`dptorch.data.banded_sampling`).
"""

from dptorch.noise.banded.accounting import accounted_steps, partition_rate_for_batch, reduction_event
from dptorch.noise.banded.choose import BandChoice, choose_bands
from dptorch.noise.banded.mechanism import NOISE_MECHANISMS
from dptorch.noise.banded.optimize import SGDWorkload, optimal_banded_strategy, prefix_sum_error
from dptorch.noise.banded.streaming import BandedNoise, banded_noise_matrix
from dptorch.noise.banded.toeplitz import BandedToeplitz, series_inverse

__all__ = [
    "NOISE_MECHANISMS",
    "BandChoice",
    "BandedNoise",
    "BandedToeplitz",
    "accounted_steps",
    "SGDWorkload",
    "banded_noise_matrix",
    "choose_bands",
    "optimal_banded_strategy",
    "partition_rate_for_batch",
    "prefix_sum_error",
    "reduction_event",
    "series_inverse",
]
