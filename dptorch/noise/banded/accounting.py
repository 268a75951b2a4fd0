"""Privacy of amplified banded matrix factorisation (Choquette-Choo et al., NeurIPS 2023).

Theorem (Amplified Banded Matrix Factorization, the b-min-separated cyclic Poisson case): let C be
a b-banded lower-triangular n x n strategy whose columns have norm at most 1, the data split into b
fixed partitions, and step t Poisson-sample partition ``t mod b`` at rate ``q_p``; release
``C x + sigma z`` (each unit's gradient clipped to norm 1). Then the mechanism is exactly as private
as DP-SGD with Poisson sampling at rate ``q_p``, noise multiplier ``sigma``, composed over
``ceil(n / b)`` steps: a unit lives in one partition, so it can take part only in steps
``k, k + b, k + 2b, ...``, at most ``ceil(n / b)`` of them, and with b bands these participations
touch disjoint row blocks of ``C x``, each of sensitivity 1.

The privacy plan records that reduction as it goes: after T steps the accountant holds
``ceil(T / b)`` Poisson-subsampled Gaussian steps (one at steps 0, b, 2b, ...), which is the
theorem applied to the first T steps (the leading T x T block of C is b-banded with column norms
at most 1 too). Continuing past the n the band was optimised for keeps the guarantee: a Toeplitz
band defines C for any number of steps with the same column norms; only the optimality is lost.
"""

from __future__ import annotations

import math

from dp_accounting import dp_event


def accounted_steps(steps: int, bands: int) -> int:
    """Poisson-subsampled Gaussian steps of the reduction after ``steps`` banded steps: ceil(steps / b)."""
    if steps < 0 or bands < 1:
        raise ValueError(f"need steps >= 0 and bands >= 1, got steps={steps}, bands={bands}")
    return -(-int(steps) // int(bands))


def reduction_event(noise_multiplier: float, partition_rate: float, steps: int, bands: int) -> dp_event.DpEvent:
    """The ``dp_accounting`` event the theorem reduces ``steps`` banded steps to."""
    gaussian = dp_event.GaussianDpEvent(noise_multiplier=noise_multiplier)
    sampled = gaussian if partition_rate == 1.0 else dp_event.PoissonSampledDpEvent(partition_rate, gaussian)
    return dp_event.SelfComposedDpEvent(event=sampled, count=accounted_steps(steps, bands))


def partition_rate_for_batch(num_samples: int, bands: int, expected_batch_size: float) -> float:
    """The per-partition Poisson rate that gives ``expected_batch_size`` per step: B * b / N."""
    rate = expected_batch_size * bands / num_samples
    if not 0 < rate <= 1:
        raise ValueError(
            f"an expected batch of {expected_batch_size:g} from one of {bands} partitions of {num_samples} samples "
            f"needs a partition sample rate of {rate:g}, outside (0, 1]: use fewer bands or a smaller batch"
        )
    return rate


__all__ = ["accounted_steps", "partition_rate_for_batch", "reduction_event"]
