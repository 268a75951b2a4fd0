"""A one-run audit of dptorch's DP-SGD with white-box Dirac gradient canaries.

The run trains a linear model ``w in R^D`` (no bias) on a linear loss ``-v <w, x>`` with the real
pipeline: ``PrivacyEngine.make_private`` (the chosen clipping and grad sample mode), the Poisson
``DPDataLoader`` and the accountant. Its data are

* ``num_canaries`` canaries, canary ``i`` owning its own random coordinate ``j_i``: input
  ``x = canary_scale * max_grad_norm * e_{j_i}``, ``v = 1``, so its per-sample gradient is
  ``-canary_scale * C * e_{j_i}``. Clipping makes it exactly ``C`` along ``e_{j_i}`` (a Dirac
  canary at the sensitivity); a run whose clipping leaks lets it through larger.
  Each canary is in the training set independently with probability 1/2.
* ``num_filler`` ordinary samples on the remaining coordinates (Gaussian inputs of norm about
  ``2 C``, signs at random), so that batches and clipping look like a real step.

The auditor sees every privatised gradient (white box: what DP-SGD releases) and scores canary
``i`` by the sum over steps of ``-grad[j_i]``: about ``C`` per step in which it was sampled, plus
Gaussian noise. :func:`~dptorch.auditing.bounds.epsilon_lower_bound` turns the scores into the
audited lower bound, compared with the epsilon the run's accountant claims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dptorch.auditing.bounds import epsilon_lower_bound
from dptorch.auditing.scores import bounds_from_scores
from dptorch.auditing.serialize import Serializable
from dptorch.data.poisson import DPDataLoader
from dptorch.engine import PrivacyEngine
from dptorch.noise import NoiseGenerator


@dataclass
class AuditResult(Serializable):
    """Outcome of one audit: both audited lower bounds against the claimed epsilon, and how they were found
    (``epsilon_lower_bound``: Steinke et al.'s, guessing both ways; ``fdp_epsilon_lower_bound``: the f-DP one,
    guessing "in" only, :func:`~dptorch.auditing.scores.bounds_from_scores`)."""

    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    confidence: float
    num_canaries: int
    num_included: int
    num_guesses: int
    num_correct: int
    fdp_epsilon_lower_bound: float
    fdp_num_guesses: int
    fdp_num_correct: int
    guesses: List[Dict[str, Any]] = field(default_factory=list)
    settings: Dict[str, Any] = field(default_factory=dict)

    @property
    def consistent(self) -> bool:
        """True when the audit does not refute the claim (both lower bounds <= claimed epsilon)."""
        return max(self.epsilon_lower_bound, self.fdp_epsilon_lower_bound) <= self.claimed_epsilon



def audit_dp_sgd(
    *,
    num_canaries: int = 500,
    noise_multiplier: float = 4.0,
    steps: int = 4,
    sample_rate: float = 1.0,
    max_grad_norm: float = 1.0,
    delta: float = 1e-5,
    confidence: float = 0.95,
    clipping: str = "flat",
    grad_sample_mode: str = "hooks",
    accountant: str = "pld",
    canary_scale: float = 10.0,
    num_filler: int = 64,
    num_guesses: Optional[int] = None,
    seed: int = 0,
    **clipping_options: Any,
) -> AuditResult:
    """Train once with canaries (see the module docstring) and audit the claimed epsilon.

    The defaults (500 canaries, sigma 4, 4 full-batch steps: a claimed epsilon of about 2 at
    delta 1e-5) take well under a second on a CPU. ``clipping_options`` go to ``make_private``
    (``gamma``, ``target_unclipped_quantile``, ...).
    """
    if not (isinstance(num_canaries, int) and num_canaries >= 2):
        raise ValueError(f"num_canaries must be a whole number >= 2, got {num_canaries!r}")
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
    if not (canary_scale > 0 and math.isfinite(canary_scale)):
        raise ValueError(f"canary_scale must be a finite number > 0, got {canary_scale!r}")
    generator = torch.Generator().manual_seed(seed)
    filler_dims = 16 if num_filler else 0
    dims = num_canaries + filler_dims
    coordinates = torch.randperm(dims, generator=generator)
    canary_coords, filler_coords = coordinates[:num_canaries], coordinates[num_canaries:]
    included = torch.rand(num_canaries, generator=generator) < 0.5

    inputs, signs = [], []
    chosen = canary_coords[included]
    canary_x = torch.zeros(len(chosen), dims)
    canary_x[torch.arange(len(chosen)), chosen] = canary_scale * max_grad_norm
    inputs.append(canary_x)
    signs.append(torch.ones(len(chosen)))
    if num_filler:
        filler_x = torch.zeros(num_filler, dims)
        filler_x[:, filler_coords] = torch.randn(num_filler, filler_dims, generator=generator) * (
            2 * max_grad_norm / math.sqrt(filler_dims))
        inputs.append(filler_x)
        signs.append(torch.randint(0, 2, (num_filler,), generator=generator).float() * 2 - 1)
    dataset = TensorDataset(torch.cat(inputs), torch.cat(signs))

    model = nn.Linear(dims, 1, bias=False)
    nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DPDataLoader(dataset, sample_rate=sample_rate, steps=steps, seed=seed)
    engine = PrivacyEngine(accountant=accountant)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, loss_reduction="sum", clipping=clipping, grad_sample_mode=grad_sample_mode,
        noise_generator=NoiseGenerator(seed=seed + 1), **clipping_options,
    )
    scores = torch.zeros(num_canaries, dtype=torch.float64)
    weight = next(p for p in optimizer.params)

    def observe(dp_optimizer: Any) -> None:  # the privatised gradient of the step: what DP-SGD releases
        scores.sub_(weight.grad.detach().reshape(-1)[canary_coords].double())

    optimizer.attach_step_hook(observe)
    try:
        for x, v in loader:
            loss = -(model(x).squeeze(-1) * v).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        claimed = engine.get_epsilon(delta)
    finally:
        engine.detach()
    found = epsilon_lower_bound(scores.tolist(), included.tolist(), delta=delta, confidence=confidence,
                                num_guesses=num_guesses)
    fdp = bounds_from_scores(scores.tolist(), included.tolist(), delta=delta, confidence=confidence,
                             num_guesses=num_guesses)["fdp"]
    settings = dict(noise_multiplier=noise_multiplier, steps=steps, sample_rate=sample_rate,
                    max_grad_norm=max_grad_norm, clipping=clipping, grad_sample_mode=grad_sample_mode,
                    accountant=accountant, canary_scale=canary_scale, num_filler=num_filler, seed=seed,
                    canaries="white-box Dirac gradient canaries", **clipping_options)
    return AuditResult(
        epsilon_lower_bound=found["epsilon_lower_bound"], claimed_epsilon=claimed, delta=delta, confidence=confidence,
        num_canaries=num_canaries, num_included=int(included.sum()), num_guesses=found["num_guesses"],
        num_correct=found["num_correct"], fdp_epsilon_lower_bound=fdp["epsilon_lower_bound"],
        fdp_num_guesses=fdp["num_guesses"], fdp_num_correct=fdp["num_correct"], guesses=found["guesses"],
        settings=settings,
    )


__all__ = ["AuditResult", "audit_dp_sgd"]
