"""How each step's batch is selected: what an accountant composes besides the Gaussian noise.

A DP-SGD step is accounted together with the way its batch was selected and the neighbouring
relation under which that selection is analysed:

* ``poisson``: every unit in independently with probability q (add-or-remove-one adjacency), the
  Poisson-subsampled Gaussian; every accountant.
* ``truncated_poisson``: Poisson at q; when more than ``batch_size`` (B) units are drawn, a
  uniformly random subset of exactly B of them is kept. dp_accounting's
  ``TruncatedSubsampledGaussianDpEvent`` (add-or-remove-one adjacency; arXiv:2508.15089, the
  accounting of JAX Privacy's truncated DP-SGD and VaultGemma's training); the 'pld' accountant only.
* ``fixed_size``: a uniformly random subset of exactly ``batch_size`` (b) of the N units, drawn
  afresh every step (sampling without replacement). dp_accounting's ``SampledWithoutReplacementDpEvent``,
  analysed under replace-one adjacency (N public) by Wang, Balle and Kasiviswanathan (2019),
  Theorem 27; the 'rdp' accountant only. Replacing a unit moves a clipped sum by up to 2C, so the
  Gaussian composed is of noise multiplier ``sigma / 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation

SELECTIONS = ("poisson", "truncated_poisson", "fixed_size")

_ADJACENCY = {"poisson": "add or remove one unit", "truncated_poisson": "add or remove one unit",
              "fixed_size": "replace one unit"}


@dataclass(frozen=True)
class Selection:
    """A batch selection: ``kind`` (one of :data:`SELECTIONS`), the ``num_units`` N it draws from and
    its ``batch_size`` (truncated Poisson: the most units kept, B; fixed size: exactly b). Poisson
    needs neither."""

    kind: str = "poisson"
    num_units: Optional[int] = None
    batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in SELECTIONS:
            raise ValueError(f"a batch selection is one of {SELECTIONS}, got {self.kind!r}")
        if self.kind == "poisson":
            if self.num_units is not None or self.batch_size is not None:
                raise ValueError("Poisson selection takes no num_units or batch_size")
            return
        for name in ("num_units", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{self.kind} selection needs {name} a whole number >= 1, got {value!r}")
        if self.batch_size > self.num_units:
            raise ValueError(f"batch_size {self.batch_size} is larger than the {self.num_units} units drawn from")

    @property
    def adjacency(self) -> str:
        """The neighbouring relation the selection's accounting assumes, in words."""
        return _ADJACENCY[self.kind]

    @property
    def neighboring_relation(self) -> NeighboringRelation:
        return NeighboringRelation.REPLACE_ONE if self.kind == "fixed_size" else NeighboringRelation.ADD_OR_REMOVE_ONE

    def check_sample_rate(self, sample_rate: float) -> float:
        """``sample_rate`` as it must be for this selection: fixed size samples at exactly b / N."""
        if self.kind == "fixed_size" and not math.isclose(sample_rate, self.batch_size / self.num_units, rel_tol=1e-12):
            raise ValueError(f"a fixed-size selection of {self.batch_size} of {self.num_units} units samples at rate "
                             f"{self.batch_size / self.num_units:g}, not {sample_rate:g}")
        return sample_rate

    def event(self, noise_multiplier: float, sample_rate: float) -> dp_event.DpEvent:
        """dp_accounting's event of one step: a Gaussian of ``noise_multiplier`` on a batch selected so."""
        sigma, q = float(noise_multiplier), self.check_sample_rate(float(sample_rate))
        if self.kind == "truncated_poisson":
            return dp_event.TruncatedSubsampledGaussianDpEvent(
                dataset_size=self.num_units, sampling_probability=q, truncated_batch_size=self.batch_size,
                noise_multiplier=sigma)
        if self.kind == "fixed_size":  # replace-one: sensitivity 2C
            return dp_event.SampledWithoutReplacementDpEvent(
                source_dataset_size=self.num_units, sample_size=self.batch_size,
                event=dp_event.GaussianDpEvent(sigma / 2.0))
        gaussian = dp_event.GaussianDpEvent(sigma)
        return gaussian if q == 1.0 else dp_event.PoissonSampledDpEvent(sampling_probability=q, event=gaussian)

    def describe(self) -> str:
        """One line for a privacy report: the selection, its event and adjacency."""
        if self.kind == "truncated_poisson":
            return (f"truncated Poisson: each unit with probability q, at most {self.batch_size} kept (a uniformly "
                    f"random subset when more are drawn), of {self.num_units}; dp_accounting's "
                    "TruncatedSubsampledGaussianDpEvent, add-or-remove-one adjacency")
        if self.kind == "fixed_size":
            return (f"fixed size: a uniformly random subset of exactly {self.batch_size} of {self.num_units} units "
                    "every step; dp_accounting's SampledWithoutReplacementDpEvent of a Gaussian of noise multiplier "
                    "noise_multiplier / 2 (RDP, Wang et al. 2019), replace-one adjacency (sensitivity 2C)")
        return "Poisson: each unit with probability q; Poisson-subsampled Gaussian, add-or-remove-one adjacency"

    def as_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "num_units": self.num_units, "batch_size": self.batch_size}

    @classmethod
    def from_dict(cls, state: Optional[Dict[str, Any]]) -> "Selection":
        """The selection of ``as_dict()`` (None: Poisson, as states saved before selections were)."""
        if state is None:
            return POISSON
        return cls(str(state["kind"]), state.get("num_units"), state.get("batch_size"))


POISSON = Selection()

__all__ = ["POISSON", "SELECTIONS", "Selection"]
