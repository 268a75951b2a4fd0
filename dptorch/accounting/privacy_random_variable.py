"""Privacy random variables of the Poisson-sampled Gaussian, discretised and composed by FFT.

Pure functions implementing the PRV accountant of Gopi, Lee and Wutschitz, "Numerical
Composition of Differential Privacy" (2021), with its error analysis:

* One step compares mu = (1-q) N(0, s^2) + q N(1, s^2) with mu0 = N(0, s^2). The privacy
  loss Y = log(P/Q)(X), X ~ P, is taken in both directions ("remove": P = mu, Q = mu0;
  "add": P = mu0, Q = mu) and the larger delta wins. Its CDF is closed form because the loss
  is monotone in X.
* Y is clipped to [lo, hi] (the clipped mass is counted in delta) and put on the grid
  {j h}: each bucket's mass sits at its centre, then the whole grid is shifted so that the
  discrete mean equals E[clip(Y)]. Then Y~ - Y lies in an interval of length h and has mean
  zero, so by Hoeffding the sum over K steps is off by at most t = h sqrt(K/2 log(2/eta))
  except with probability eta.
* The K-fold sum is one FFT power per run; a Chernoff bound on the discrete sum sizes the
  FFT window so that wrapped-around mass is below a set budget.
* FFT round-off, estimated from the negative masses it leaves, is added to the delta slack
  (it matters only for delta below ~1e-10, where double precision runs out).
* delta(eps) = E[(1 - exp(eps - Y))_+] is then piecewise of the form a - b e^eps between grid
  points, so eps for a given delta is solved exactly on the discrete distribution.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import List, NamedTuple, Sequence, Tuple

import numpy as np
from scipy import fft as sp_fft
from scipy import integrate
from scipy.special import logsumexp, ndtr, ndtri

REMOVE = "remove"
ADD = "add"

#: Largest grid (points) the PRV accountant will allocate; beyond it, ask for a coarser one.
MAX_GRID_POINTS = 2**25


def _check_grid_size(points: int, what: str) -> None:
    if points > MAX_GRID_POINTS:
        raise ValueError(
            f"the PRV accountant would need {points:,} grid points for {what} (limit {MAX_GRID_POINTS:,}); "
            "pass a larger eps_error to PRVAccountant or use the 'pld' accountant"
        )


class EpsilonBounds(NamedTuple):
    """Epsilon of the discrete computation and the proven bounds around it."""

    lower: float
    estimate: float
    upper: float


# -- one step -------------------------------------------------------------------------------


def _remove_loss_of_x(x: np.ndarray, sigma: float, q: float) -> np.ndarray:
    """Privacy loss log(mu(x) / mu0(x)); increasing in x."""
    log_1mq = math.log1p(-q) if q < 1 else -math.inf
    return np.logaddexp(log_1mq, math.log(q) + (2 * np.asarray(x, dtype=float) - 1) / (2 * sigma**2))


def _x_of_remove_loss(y: np.ndarray, sigma: float, q: float) -> np.ndarray:
    """Inverse of :func:`_remove_loss_of_x`; -inf where the loss is below its minimum log(1-q)."""
    y = np.asarray(y, dtype=float)
    log_1mq = math.log1p(-q) if q < 1 else -math.inf
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # below log(1-q): discarded
        # log(e^y - (1 - q)) = y + log(1 - e^(log(1-q) - y))
        log_excess = y + np.log(-np.expm1(log_1mq - y))
        x = sigma**2 * (log_excess - math.log(q)) + 0.5
    return np.where(y > log_1mq, x, -np.inf)


def loss_cdf_and_sf(y: np.ndarray, sigma: float, q: float, direction: str) -> Tuple[np.ndarray, np.ndarray]:
    """P(Y <= y) and P(Y > y) for one step's privacy loss Y in the given direction."""
    if direction == REMOVE:
        x = _x_of_remove_loss(y, sigma, q)
        cdf = (1 - q) * ndtr(x / sigma) + q * ndtr((x - 1) / sigma)
        sf = (1 - q) * ndtr(-x / sigma) + q * ndtr((1 - x) / sigma)
    else:
        # Y = -loss_remove(X) with X ~ N(0, s^2): Y <= y  <=>  X >= x(-y).
        x = _x_of_remove_loss(-np.asarray(y, dtype=float), sigma, q)
        cdf = ndtr(-x / sigma)
        sf = ndtr(x / sigma)
    return cdf, sf


def _clipped_loss_mean(sigma: float, q: float, direction: str, lo: float, hi: float) -> Tuple[float, float]:
    """E[clip(Y, lo, hi)] and an error estimate, integrating over each Gaussian component of X in
    its own standard units z (X = centre + sigma z), where the integrand is smooth and its mass
    is not a spike of width sigma (at sigma 1e-5 an integral over X missed most of it)."""
    sign = 1.0 if direction == REMOVE else -1.0
    components = [(1 - q, 0.0), (q, 1.0)] if direction == REMOVE else [(1.0, 0.0)]
    # In X the clip points are x(lo), x(hi) (swapped for "add", where Y decreases in X).
    x_ends = [float(v) for v in _x_of_remove_loss(np.array([sign * lo, sign * hi]), sigma, q)]
    mean, error = 0.0, 0.0
    for weight, centre in components:
        if weight == 0:
            continue
        kinks = sorted(z for z in ((x - centre) / sigma for x in x_ends) if -40 < z < 40)

        def integrand(z: float, centre: float = centre) -> float:
            loss = sign * float(_remove_loss_of_x(centre + sigma * z, sigma, q))
            return min(max(loss, lo), hi) * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", integrate.IntegrationWarning)
            value, part_error = integrate.quad(
                integrand, -40.0, 40.0, points=kinks or None, limit=500, epsabs=1e-14, epsrel=1e-12
            )
        if caught:  # roundoff kept quad from its tolerance: take a generous error instead
            part_error = max(part_error, 1e-9 * abs(value) + 1e-13)
        mean += weight * value
        error += weight * abs(part_error)
    # Mass beyond +-40 standard deviations is < 1e-300: nothing to add to the error.
    return mean, error


@dataclass(frozen=True)
class DiscreteLoss:
    """One step's clipped privacy loss on the grid: mass ``probs[i]`` at ``(first + i) * h + shift``."""

    first: int
    probs: np.ndarray
    shift: float
    clipped_mass: float
    mean_error: float


@lru_cache(maxsize=64)
def discretise_loss(sigma: float, q: float, direction: str, mesh: float, tail_mass: float) -> DiscreteLoss:
    """Discretise one step's privacy loss with mesh ``mesh``, clipping at most ``tail_mass`` per tail."""
    z = float(ndtri(tail_mass))  # negative
    if direction == REMOVE:
        # Both mixture components have CDF <= Phi(x / s) and survival <= Phi((1 - x) / s).
        y_lo, y_hi = _remove_loss_of_x(np.array([sigma * z, 1 - sigma * z]), sigma, q)
    else:
        y_lo, y_hi = -_remove_loss_of_x(np.array([-sigma * z, sigma * z]), sigma, q)
    first = math.floor(y_lo / mesh)
    last = math.ceil(y_hi / mesh)
    _check_grid_size(last - first + 1, "one step")
    edges = (np.arange(first, last + 2) - 0.5) * mesh
    cdf, sf = loss_cdf_and_sf(edges, sigma, q, direction)
    # Differences of the CDF below the median, of the survival function above: no cancellation.
    probs = np.where(cdf[1:] <= 0.5, cdf[1:] - cdf[:-1], sf[:-1] - sf[1:])
    clipped_mass = float(cdf[0] + sf[-1])
    probs[0] += cdf[0]
    probs[-1] += sf[-1]
    probs = np.clip(probs, 0.0, None)
    mean, mean_error = _clipped_loss_mean(sigma, q, direction, float(edges[0]), float(edges[-1]))
    grid_mean = float(np.dot(probs, np.arange(first, last + 1) * mesh))
    shift = mean - grid_mean
    # every bucket's losses lie within h / 2 of its centre, so must the means: else the integral failed
    if not abs(shift) <= mesh / 2 * (1 + 1e-9) + mean_error + 1e-12 * abs(mean):
        raise ValueError(
            f"the PRV accountant cannot discretise the privacy loss at noise_multiplier={sigma:g}, sample_rate={q:g} "
            f"(its mean is off the grid by {shift / mesh:.3g} grid steps); use the 'rdp' accountant"
        )
    probs.setflags(write=False)
    return DiscreteLoss(first, probs, shift, clipped_mass, mean_error)


# -- composition ----------------------------------------------------------------------------


def _log_mgf(loss: DiscreteLoss, mesh: float, lambdas: np.ndarray) -> np.ndarray:
    """log E[exp(lambda Y~)] of the discrete loss, for each lambda."""
    values = (loss.first + np.arange(len(loss.probs))) * mesh + loss.shift
    support = loss.probs > 0
    log_p, values = np.log(loss.probs[support]), values[support]
    return np.array([logsumexp(log_p + lam * values) for lam in lambdas])


def _chernoff_bound(losses: Sequence[Tuple[DiscreteLoss, int]], mesh: float, tail_mass: float, sign: float) -> float:
    """t with P(sign * sum Y~ >= t) <= tail_mass, minimising the Chernoff bound over lambda.

    The bound (cgf(lambda) + log(1 / tail_mass)) / lambda is unimodal in lambda; any lambda
    gives a valid bound, so a coarse log grid refined once around its best point suffices.
    """
    log_tail = math.log(1 / tail_mass)

    def bounds(lambdas: np.ndarray) -> np.ndarray:
        cgf = sum(count * _log_mgf(loss, mesh, sign * lambdas) for loss, count in losses)
        return (cgf + log_tail) / lambdas

    coarse = np.geomspace(1e-2, 1e3, 8)
    best = coarse[int(np.argmin(bounds(coarse)))]
    fine = np.geomspace(best / 2.5, best * 2.5, 6)
    return float(np.min(bounds(fine)))


def _chernoff_window(losses: Sequence[Tuple[DiscreteLoss, int]], mesh: float, tail_mass: float) -> Tuple[float, float]:
    """[lo, hi] holding the sum of the discrete losses except for <= tail_mass on each side."""
    return -_chernoff_bound(losses, mesh, tail_mass, -1.0), _chernoff_bound(losses, mesh, tail_mass, 1.0)


@dataclass(frozen=True)
class ComposedLoss:
    """Distribution of the summed discrete losses: mass ``probs[i]`` at ``values[i]`` (ascending)."""

    values: np.ndarray
    probs: np.ndarray
    delta_error: float
    epsilon_error: float


def _wrapped_spectrum(loss: DiscreteLoss, size: int) -> np.ndarray:
    """rfft of the loss's masses placed at their grid index modulo ``size``."""
    indices = (loss.first + np.arange(len(loss.probs))) % size
    return sp_fft.rfft(np.bincount(indices, weights=loss.probs, minlength=size))


def _fft_layout(window: Tuple[float, float], offset: float, mesh: float) -> Tuple[int, int]:
    """(first grid index, FFT size) covering the window of summed values."""
    index_lo = math.floor((window[0] - offset) / mesh) - 1
    index_hi = math.ceil((window[1] - offset) / mesh) + 1
    _check_grid_size(index_hi - index_lo + 1, "the composition")
    return index_lo, sp_fft.next_fast_len(index_hi - index_lo + 1, real=True)


def _composed_loss(
    spectrum: np.ndarray,
    index_lo: int,
    size: int,
    offset: float,
    mesh: float,
    delta_error: float,
    losses: Sequence[Tuple[DiscreteLoss, int]],
) -> ComposedLoss:
    """Back from the product spectrum to masses and values, with the error budget of the sum.

    ``delta_error`` is split: half for the Hoeffding rounding bound, a quarter for clipping the
    steps and a quarter for the FFT window; the estimated FFT round-off comes on top.
    """
    raw = sp_fft.irfft(spectrum, size)
    # FFT round-off (~1e-18 per entry) shows as negative masses where the true mass is ~0;
    # their mean size times the number of entries estimates the round-off in any delta.
    negative = raw[raw < 0]
    fft_noise = size * float(-negative.mean()) if len(negative) else 0.0
    composed = np.clip(raw, 0.0, None)
    # Position m of the circular result holds grid sum index_lo + ((m - index_lo) mod size).
    probs = np.roll(composed, -(index_lo % size))
    values = (index_lo + np.arange(size)) * mesh + offset
    total_steps = sum(count for _, count in losses)
    hoeffding_eta = delta_error / 2
    clipped = sum(count * loss.clipped_mass for loss, count in losses)
    epsilon_error = mesh * math.sqrt(total_steps / 2 * math.log(2 / hoeffding_eta)) + sum(
        count * loss.mean_error for loss, count in losses
    )
    return ComposedLoss(values, probs, hoeffding_eta + clipped + delta_error / 4 + fft_noise, epsilon_error)


def compose_losses(
    runs: Sequence[Tuple[float, float, int]], direction: str, mesh: float, delta_error: float
) -> ComposedLoss:
    """Sum of the privacy losses of all steps in ``runs`` ([(sigma, q, count)]) in one direction.

    The result carries its slack: delta (``delta_error`` plus the estimated FFT round-off)
    and epsilon (the Hoeffding bound of the rounding).
    """
    total_steps = sum(count for _, _, count in runs)
    clip_per_tail = delta_error / (8 * total_steps)
    losses = [(discretise_loss(sigma, q, direction, mesh, clip_per_tail), count) for sigma, q, count in runs]
    offset = sum(count * loss.shift for loss, count in losses)
    index_lo, size = _fft_layout(_chernoff_window(losses, mesh, delta_error / 8), offset, mesh)
    spectrum = None
    for loss, count in losses:
        factor = _wrapped_spectrum(loss, size) ** count
        spectrum = factor if spectrum is None else spectrum * factor
    return _composed_loss(spectrum, index_lo, size, offset, mesh, delta_error, losses)


def compose_loss_over_counts(
    sigma: float, q: float, direction: str, mesh: float, delta_error: float, counts: Sequence[int]
) -> List[ComposedLoss]:
    """:func:`compose_losses` for one (sigma, q) at several step counts (> 0), sharing one FFT.

    The mesh and clipping suit the largest count and are only more accurate for the others.
    """
    clip_per_tail = delta_error / (8 * max(counts))
    loss = discretise_loss(sigma, q, direction, mesh, clip_per_tail)
    lambdas = np.geomspace(1e-2, 1e3, 24)
    log_tail = math.log(8 / delta_error)
    cgf_up, cgf_down = _log_mgf(loss, mesh, lambdas), _log_mgf(loss, mesh, -lambdas)
    window_lo = min(-float(np.min((count * cgf_down + log_tail) / lambdas)) for count in counts)
    window_hi = max(float(np.min((count * cgf_up + log_tail) / lambdas)) for count in counts)
    # Offsets differ per count (count * shift, |shift| <= mesh / 2): widen the window by the largest.
    spread = max(counts) * abs(loss.shift)
    index_lo, size = _fft_layout((window_lo - spread, window_hi + spread), 0.0, mesh)
    spectrum = _wrapped_spectrum(loss, size)
    # Walk up the sorted counts multiplying by spectrum^gap: far cheaper than a power per count.
    gap_powers = {}
    power, previous, results = np.ones_like(spectrum), 0, []
    for count in sorted(counts):
        gap = count - previous
        if gap not in gap_powers:
            gap_powers[gap] = spectrum**gap
        power, previous = power * gap_powers[gap], count
        results.append(
            _composed_loss(power, index_lo, size, count * loss.shift, mesh, delta_error, [(loss, count)])
        )
    by_count = dict(zip(sorted(counts), results))
    return [by_count[count] for count in counts]


class DeltaCurve:
    """delta(eps) = sum_v p(v) (1 - e^(eps - v))_+ of a discrete loss, inverted exactly.

    Between neighbouring grid values delta is S1 - e^eps S2 (S1, S2: mass and e^-v-weighted
    mass above eps), so eps = log((S1 - delta) / S2) once the right interval is found.
    """

    def __init__(self, values: np.ndarray, probs: np.ndarray) -> None:
        positive = values > 0
        self._v = values[positive][::-1]  # descending
        p = probs[positive][::-1]
        self._mass_above = np.cumsum(p)
        # log of the running sum of p e^-v: scaled by e^v[0] when the values span < 700 nats
        # (exact and fast), else in log space throughout.
        with np.errstate(divide="ignore"):
            if len(p) and self._v[0] - self._v[-1] < 700:
                top = self._v[0]
                self._log_weighted = np.log(np.cumsum(p * np.exp(top - self._v))) - top
            else:
                self._log_weighted = np.logaddexp.accumulate(np.log(p) - self._v)
        # delta at eps = v[k+1] (increasing in k), and at eps = 0.
        self._delta_at_grid = self._mass_above[:-1] - np.exp(self._log_weighted[:-1] + self._v[1:])
        self._delta_at_zero = (
            float(self._mass_above[-1] - math.exp(self._log_weighted[-1])) if len(p) else 0.0
        )

    def epsilon(self, delta: float) -> float:
        """Smallest eps >= 0 with delta(eps) <= ``delta``; inf when ``delta`` <= 0."""
        if delta <= 0:
            return math.inf
        if self._delta_at_zero <= delta:
            return 0.0
        # First k whose lower end v[k+1] already gives more than delta: eps in (v[k+1], v[k]].
        k = int(np.searchsorted(self._delta_at_grid, delta, side="right"))
        if self._mass_above[k] <= delta:
            return float(self._v[k])
        return float(math.log(self._mass_above[k] - delta) - self._log_weighted[k])


def epsilon_bounds(composed: List[ComposedLoss], delta: float) -> EpsilonBounds:
    """Epsilon (estimate and proven bounds) of the larger of the directions in ``composed``."""
    lower = estimate = upper = 0.0
    for loss in composed:
        curve = DeltaCurve(loss.values, loss.probs)
        estimate = max(estimate, curve.epsilon(delta))
        upper = max(upper, curve.epsilon(delta - loss.delta_error) + loss.epsilon_error)
        lower = max(lower, curve.epsilon(delta + loss.delta_error) - loss.epsilon_error)
    return EpsilonBounds(lower, estimate, upper)
