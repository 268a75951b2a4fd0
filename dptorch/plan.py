"""PrivacyPlan: the one object that owns what must agree for a DP-SGD guarantee to hold.

The guarantee of a run is a statement about its sample rate ``q`` and step count as the sampler
really draws them, the noise multiplier and clipping bound of the mechanism that privatises each
step, and the accountant that composes the steps. Those used to be wired separately by the
engine, the optimizer, calibration, the Trainer's budget and the checkpoints; now each of them
reads (and only the optimizer writes) one plan:

* the sampler's numbers: ``sample_rate``, ``steps_per_epoch`` and ``num_units`` are taken from the
  Poisson sampler the run iterates (``for_sampler``) or handed to the sampler the run builds
  (the Trainer), never recomputed elsewhere;
* the mechanism: ``mechanism`` ("gaussian": independent Gaussian noise, DP-SGD),
  ``noise_multiplier``, ``max_grad_norm`` and ``clipping``; the optimizer's noise std and the
  ``divisor`` of the update (``expected_batch_size``, a constant fixed at construction, never a
  drawn batch's size) come from here; ``sample_rate``, ``num_units`` and ``divisor`` are read-only. With adaptive clipping (or private clipping
  statistics) each step also releases a noised count of unclipped units (std
  ``count_noise_std``): the gradient noise is then ``gradient_noise_multiplier`` (raised so that
  the two Gaussian queries compose to ``noise_multiplier``, see :mod:`dptorch.clipping.adaptive`),
  and the accountant still records one Gaussian of ``noise_multiplier`` per step. Adaptive
  clipping moves ``max_grad_norm`` (the optimizer writes it after every step; checkpoints keep it);
* calibration: ``PrivacyPlan.calibrated`` chooses the noise multiplier for exactly the plan's
  ``sample_rate`` and planned steps (``planned_steps``), the ones the accountant will record;
* accounting: the optimizer calls ``close_step`` and ``record_steps`` once per logical step;
  ``epsilon``, ``epsilon_after`` and ``report`` read the accountant through the plan;
* checkpoints: ``state_dict`` / ``load_state_dict`` (refusing a checkpoint whose sampling differs).

With ``track_draws=True`` (the engine) the plan also keeps a ``DrawLedger``: the DP data loader
reports each Poisson draw it hands to the training loop, the optimizer each backward round, and
at ``optimizer.step()`` the plan refuses a step fed by several draws, one whose backward passes saw
samples while no draw was pending (data that did not come from the DP loader), or whose backward
passes saw another number of samples than the draw holds (``SamplingMismatchError``), before any
gradient or parameter changes. A draw that fed no backward pass is accounted as a step of its own, so every
draw handed to the loop is accounted.

With ``mechanism="bandmf"`` (banded matrix-factorisation noise, ``strategy`` a normalised
``BandedToeplitz`` of b bands, sampled by a b-min-separated cyclic Poisson loader at the partition
rate ``sample_rate``) the accountant records ``ceil(steps / b)`` Poisson-subsampled Gaussian steps
(the amplified banded MF theorem, :mod:`dptorch.noise.banded.accounting`); ``noise_step_index``
tells the banded noise which step it privatises and ``check_partition`` refuses a draw whose
partition is not the step's.

With ``sampling="truncated_poisson"`` or ``"fixed_size"`` (static-shape batches,
:mod:`dptorch.data.truncated_poisson`, :mod:`dptorch.data.fixed_size`) the plan's ``selection``
(:mod:`dptorch.accounting.selection`) tells the accountant how each step's batch was selected; the
accountant must be able to compose it ('pld' truncated Poisson, 'rdp' fixed size). A truncated
Poisson draw comes padded to its maximum: the ledger learns its real rows and its padded rows, and
``padding_mask`` tells the optimizer which rows of each backward round are padding, whose clipped
contribution it drops.

With ``sampling="shuffled"`` (``make_private(poisson_sampling=False)``: fixed-size batches, each
sample once per pass, :mod:`dptorch.data.shuffled`) no subsampling is claimed: each pass over the
data is accounted as one Gaussian of noise multiplier ``sigma / 2`` at sample rate 1 (replace-one
adjacency, sensitivity 2C), counted from its first batch handed out; a step may hold several
batches of one pass, never of two. ``sample_rate`` is then the batch's fraction of the data, which
no accountant uses.

``noise_multiplier == 0`` is allowed (clipping-only ablation): such steps are counted, nothing is
private and ``epsilon`` is infinite.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from dptorch.accounting import Accountant, create_accountant, get_noise_multiplier
from dptorch.accounting.selection import POISSON, Selection
from dptorch.accounting.validation import check_delta_for_units, is_number
from dptorch.clipping.adaptive import CLIPPING_STATS, AdaptiveClipping, default_unclipped_num_std, gradient_noise_multiplier
from dptorch.clipping.checks import MaxGradNorm, check_clipping
from dptorch.clipping.factors import DEFAULT_GAMMA, total_norm_bound
from dptorch.noise.banded.toeplitz import BandedToeplitz

#: Noise mechanisms a plan can describe. "gaussian": independent Gaussian noise per step (DP-SGD);
#: "bandmf": banded matrix-factorisation noise (correlated across steps, ``dptorch.noise.banded``),
#: accounted by the amplified banded MF theorem under b-min-separated cyclic Poisson sampling.
MECHANISMS = ("gaussian", "bandmf")

_STATE_VERSION = 1


class SamplingMismatchError(RuntimeError):
    """The training loop did not use the Poisson draws the way the accountant records them."""


def check_noise_multiplier(value: Any) -> float:
    """A finite noise multiplier >= 0 (0: clipping only, no privacy)."""
    if not is_number(value) or not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {value!r}")
    return float(value)


def planned_steps(steps_per_epoch: Optional[int], epochs: Optional[float] = None, steps: Optional[int] = None) -> int:
    """The steps a run will take: ``steps``, or ``epochs`` passes of ``steps_per_epoch`` draws."""
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs or steps")
    if steps is not None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
        return steps
    if not is_number(epochs) or not (epochs > 0 and math.isfinite(epochs)):
        raise ValueError(f"epochs must be a finite number > 0, got {epochs!r}")
    if not steps_per_epoch:
        raise ValueError("epochs needs the sampler's steps per epoch; give steps instead")
    exact = epochs * steps_per_epoch
    nearest = round(exact)
    # 3 epochs of 0.1-epoch draws is 3 * 10 = 30 steps, not 31 from a rounding error.
    return int(nearest) if abs(exact - nearest) <= 1e-9 * max(1.0, exact) else math.ceil(exact)


class DrawLedger:
    """Poisson draws handed to the training loop since the last step, and what the backward passes saw.

    ``used[i]``: a backward round whose clipped gradients are still held in the optimizer ran while
    draw ``i`` was the latest one. ``rows``: the samples those rounds saw (per-sample gradient rows).
    ``undrawn``: the samples of rounds that ran while no draw was pending (data that did not come
    from the DP data loader: the original loader, the whole dataset); a step holding any is refused.

    Shuffled batches (:mod:`dptorch.data.shuffled`): every batch comes with its pass, ``new_passes``
    counts the passes whose first batch was handed out since the last step, and a step may hold
    several batches, all of one pass.

    Padded draws (truncated Poisson): ``padded[i]`` is the rows draw ``i`` reached the loop with (its
    ``sizes[i]`` real rows first, then padding rows), None for an unpadded draw; see :meth:`padding_mask`.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.sizes: List[Optional[int]] = []
        self.padded: List[Optional[int]] = []
        self.used: List[bool] = []
        self.passes: List[Optional[int]] = []
        self.new_passes = 0
        self.rows = 0
        self.undrawn = 0
        self.grouped = False

    def on_draw(self, size: Optional[int], pass_id: Optional[int] = None, new_pass: bool = False,
                padded: Optional[int] = None) -> None:
        if padded is not None and (size is None or not 0 <= size <= padded):
            raise SamplingMismatchError(f"a padded draw of {padded} rows must say how many of them are real (got {size})")
        self.sizes.append(None if size is None else int(size))
        self.padded.append(None if padded is None else int(padded))
        self.used.append(False)
        self.passes.append(pass_id)
        self.new_passes += int(new_pass)

    def padding_mask(self, rows: int, grouped: bool, whole_draw: bool) -> Optional[torch.Tensor]:
        """Which of the next backward round's ``rows`` rows are padding of the latest draw (None: none are).

        A padded draw's padding rows are known by their place only (at and past its real rows), so a round
        on it must have run the model on the whole latest draw, its rows in the order handed out
        (``whole_draw``, the controller's draw watch says so); any other round is refused before its
        gradients are kept: a batch of an earlier draw (its padding rows would be counted as real rows), a
        part of the batch, its rows reordered, rows grouped into privacy units."""
        if not self.padded or self.padded[-1] is None:
            return None
        if grouped or not whole_draw or rows != self.padded[-1]:
            what = ("its rows grouped into privacy units (hooks.set_privacy_units)" if grouped else
                    f"{rows} rows" if rows != self.padded[-1] else "a batch other than the latest draw's")
            raise SamplingMismatchError(
                f"a backward pass on {what}, while the latest draw of the padded (truncated Poisson) loader has "
                f"{self.padded[-1]} rows ({self.sizes[-1]} real, then {self.padded[-1] - self.sizes[-1]} padding): "
                "padding rows are told apart by their place in the latest batch only. Run the model on each batch as "
                "the loader hands it out (derived by torch operations, e.g. .to(device), but all its rows, in order), "
                "before taking the next one. Nothing was kept; call optimizer.zero_grad() to drop the refused pass"
            )
        return torch.arange(int(rows)) >= self.sizes[-1]

    def on_backward(self, rows: int, grouped: bool) -> None:
        self.rows += int(rows)
        self.grouped = self.grouped or grouped
        if self.used:
            self.used[-1] = True
        else:
            self.undrawn += int(rows)

    def on_discard(self) -> None:
        """The held clipped gradients were dropped (``zero_grad`` outside a virtual step)."""
        self.used = [False] * len(self.used)
        self.rows = 0
        self.undrawn = 0
        self.grouped = False

    def close_step(self, *, sample_rate: Optional[float], batch_first: Optional[bool], shuffled: bool = False) -> int:
        """Check the step about to be privatised; return the draws to account (at least 1); reset.
        With ``shuffled``: return the passes to account (those begun since the last step, maybe 0).

        Raises ``SamplingMismatchError`` (and keeps the ledger) when the held gradients saw samples
        while no draw was pending, come from several draws (shuffled: batches of several passes),
        or when their rows differ from the samples of the draws they come from.
        """
        if self.undrawn:
            raise SamplingMismatchError(_undrawn_message(self.undrawn, self.grouped, sample_rate))
        used = [i for i, flag in enumerate(self.used) if flag]
        if shuffled:
            return self._close_shuffled_step(used, batch_first)
        if len(used) > 1:
            rate = "" if sample_rate is None else f" of sample rate {sample_rate:g}"
            raise SamplingMismatchError(
                f"optimizer.step() would privatise the gradients of {len(used)} batches drawn from the DP data "
                f"loader since the last step, but a step is accounted as one Poisson batch{rate}: several draws "
                "summed under one noise draw spend more privacy than the accountant records. Call optimizer.step() "
                "after every batch of the DP data loader; for larger batches raise the sample rate (a larger "
                "batch_size) and split each batch with BatchMemoryManager(max_physical_batch_size=...). Nothing "
                "was updated; call optimizer.zero_grad() to drop the held gradients"
            )
        if used and not self.grouped:
            size = self.sizes[used[0]] if self.padded[used[0]] is None else self.padded[used[0]]
            if size is not None and size != self.rows:
                raise SamplingMismatchError(_count_message(self.rows, size, batch_first))
        count = max(1, len(self.sizes))
        self._reset()
        return count

    def _close_shuffled_step(self, used: List[int], batch_first: Optional[bool]) -> int:
        if len({self.passes[i] for i in used}) > 1:
            raise SamplingMismatchError(
                "optimizer.step() would privatise batches of two passes over the shuffled data loader (two live "
                "iterators, or a step left open across the end of a pass): a sample can be in both, so one step would "
                "hold it twice (sensitivity 4C) while each pass is accounted as one use of every sample. Take the step "
                "before the pass ends and iterate one pass at a time. Nothing was updated; call optimizer.zero_grad() "
                "to drop the held gradients"
            )
        sizes = [self.sizes[i] for i in used]
        if used and not self.grouped and None not in sizes and sum(sizes) != self.rows:
            raise SamplingMismatchError(_count_message(self.rows, sum(sizes), batch_first))
        passes = self.new_passes
        self._reset()
        return passes

    def state_dict(self) -> Dict[str, Any]:
        return {
            "sizes": [-1 if s is None else s for s in self.sizes],
            "padded": [-1 if p is None else p for p in self.padded],
            "passes": [-1 if p is None else p for p in self.passes],
            "new_passes": self.new_passes,
            "used": list(self.used),
            "rows": self.rows,
            "undrawn": self.undrawn,
            "grouped": self.grouped,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.sizes = [None if s < 0 else int(s) for s in state["sizes"]]
        self.padded = [None if p < 0 else int(p) for p in state.get("padded", [-1] * len(self.sizes))]
        self.used = [bool(u) for u in state["used"]]
        self.passes = [None if p < 0 else int(p) for p in state.get("passes", [-1] * len(self.sizes))]
        self.new_passes = int(state.get("new_passes", 0))
        self.rows = int(state["rows"])
        self.undrawn = int(state.get("undrawn", 0))
        self.grouped = bool(state["grouped"])


def _undrawn_message(undrawn: int, grouped: bool, sample_rate: Optional[float]) -> str:
    what = "privacy units" if grouped else "samples"
    rate = "" if sample_rate is None else f" of sample rate {sample_rate:g}"
    return (
        f"optimizer.step() would privatise the clipped gradients of {undrawn} {what} that no Poisson draw of the DP "
        "data loader gave the training loop: the backward passes since the last step ran on other data (the "
        "original DataLoader, the whole dataset, a batch built by hand). The accountant would record a Poisson-"
        f"subsampled step{rate} that never happened; a step on the whole dataset is a step at sample rate 1 and "
        "costs far more privacy. Iterate the data loader make_private returned: `model, optimizer, data_loader = "
        "engine.make_private(...)`, then `for batch in data_loader:` (with BatchMemoryManager, pass it that "
        "loader). Nothing was updated; call optimizer.zero_grad() to drop the held gradients"
    )


def _count_message(rows: int, size: int, batch_first: Optional[bool]) -> str:
    message = f"the backward passes of this step saw {rows} samples, but the DP data loader drew {size} for it. "
    if batch_first is False:
        message += (
            "With batch_first=False dim 1 of every input is taken as the batch dimension, so batch-first data has "
            "its time steps counted as samples (each clipped on its own: a real sample could contribute several "
            "times the clipping bound). Pass batch_first=True to make_private, or feed (T, N, ...) inputs."
        )
    else:
        message += (
            "With batch_first=True dim 0 of every input is taken as the batch dimension: if the model's inputs are "
            "(T, N, ...), pass batch_first=False to make_private. Also check that the batch was not repeated, "
            "augmented into more rows or joined with other data."
        )
    return message + " If one sample spans several rows on purpose, group them with hooks.set_privacy_units(unit_ids)."


def _divisor(given: Optional[float], sample_rate: Optional[float], num_units: Optional[int], bands: int) -> Optional[float]:
    """The plan's constant divisor: ``given``, else ``q * N / bands``; None when neither is known."""
    if given is not None:
        if not is_number(given) or not (given > 0 and math.isfinite(given)):
            raise ValueError(f"expected_batch_size must be a finite number > 0, got {given!r}")
        return float(given)
    if sample_rate is None or num_units is None:
        return None
    return sample_rate * num_units / bands


def _check_strategy(mechanism: str, strategy: Any) -> Any:
    """The banded strategy of a "bandmf" plan (normalised columns), None for independent noise."""
    if mechanism != "bandmf":
        if strategy is not None:
            raise ValueError(f"a strategy was given with mechanism={mechanism!r}; it is for mechanism='bandmf'")
        return None
    if not isinstance(strategy, BandedToeplitz):
        raise ValueError("mechanism='bandmf' needs strategy=BandedToeplitz(...) (see dptorch.noise.banded)")
    strategy.check_normalised()  # the reduction assumes column norms <= 1
    return strategy


def _check_selection(sampling: Optional[str], selection: Optional[Selection], sample_rate: Optional[float],
                     num_units: Optional[int]) -> Selection:
    """The plan's batch selection: ``selection`` for the static-shape samplings (its kind is ``sampling``, its
    units the plan's), Poisson otherwise."""
    if sampling not in ("truncated_poisson", "fixed_size"):
        if selection is not None and selection.kind != "poisson":
            raise ValueError(f"a {selection.kind} selection was given with sampling={sampling!r}")
        return POISSON
    if selection is None or selection.kind != sampling:
        raise ValueError(f"sampling={sampling!r} needs selection=Selection({sampling!r}, num_units, batch_size)")
    if num_units is not None and selection.num_units != num_units:
        raise ValueError(f"the selection draws from {selection.num_units} units, the plan has num_units={num_units}")
    if sample_rate is not None:
        selection.check_sample_rate(float(sample_rate))
    return selection


def sampler_fields(batch_sampler: Any) -> Dict[str, Any]:
    """The plan fields a batch sampler decides: q, draws per epoch, N, and where it says so, the
    expected batch (cyclic Poisson: ``q_p * N / b``) and the sampling kind (shuffled batches)."""
    fields: Dict[str, Any] = dict(sample_rate=batch_sampler.sample_rate, steps_per_epoch=batch_sampler.steps,
                                  num_units=batch_sampler.num_samples)
    if hasattr(batch_sampler, "global_expected_batch_size"):
        fields["expected_batch_size"] = batch_sampler.global_expected_batch_size
    if getattr(batch_sampler, "sampling", "poisson") == "shuffled":
        fields.update(sampling="shuffled", expected_batch_size=batch_sampler.expected_batch_size)
    selection = getattr(batch_sampler, "selection", None)
    if selection is not None and selection.kind != "poisson":  # static-shape selections
        fields.update(sampling=selection.kind, selection=selection, expected_batch_size=batch_sampler.expected_batch_size)
    return fields


class PrivacyPlan:
    """Sample rate, steps, mechanism, clipping bound and accountant of one private run.

    ``accountant`` is a name ("pld", "prv", "rdp", "gdp"), an ``Accountant`` (its history is kept),
    or None (steps are counted but not accounted: a bare ``DPOptimizer``). ``expected_batch_size``
    defaults to ``sample_rate * num_units``, the expected (global) logical batch. ``sampling`` is
    "poisson" when the batches come from a Poisson sampler with ``sample_rate``, "shuffled" for
    fixed-size batches accounted per pass (needs ``track_draws``), "truncated_poisson" or
    "fixed_size" for the static-shape selections that ``selection`` describes
    (:class:`~dptorch.accounting.selection.Selection`; truncated Poisson needs ``track_draws``, which
    masks its padding rows), None when unknown.

    Clipping options: ``gamma`` (automatic clipping, default 0.01), ``adaptive``
    (:class:`~dptorch.clipping.adaptive.AdaptiveClipping`, for ``clipping="adaptive"``; default
    settings when None), ``clipping_stats`` (None, "raw" or "private") and ``unclipped_num_std``
    (the noise of the released count; default ``expected_batch_size / 20``);
    :func:`~dptorch.clipping.adaptive.clipping_plan_fields` builds them from keyword options.
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        max_grad_norm: Optional[MaxGradNorm] = None,
        clipping: str = "flat",
        sample_rate: Optional[float] = None,
        num_units: Optional[int] = None,
        steps_per_epoch: Optional[int] = None,
        accountant: Union[str, Accountant, None] = "pld",
        mechanism: str = "gaussian",
        sampling: Optional[str] = "poisson",
        secure_mode: bool = False,
        expected_batch_size: Optional[float] = None,
        planned_steps: Optional[int] = None,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        track_draws: bool = False,
        gamma: Optional[float] = None,
        adaptive: Optional[Any] = None,
        clipping_stats: Optional[str] = None,
        unclipped_num_std: Optional[float] = None,
        strategy: Optional[Any] = None,
        selection: Optional[Selection] = None,
    ) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
        #: mechanism "bandmf": the banded strategy C (``dptorch.noise.banded.BandedToeplitz``); else None.
        self.strategy = _check_strategy(mechanism, strategy)
        #: Bands b of the strategy (1 for independent noise): the reduction accounts ceil(steps / b) steps.
        self.bands = self.strategy.bands if self.strategy is not None else 1
        self._closing = 1  # draws accounted by the step being privatised (set by close_step)
        self._warned_horizon = False
        if sample_rate is not None and not (is_number(sample_rate) and 0 < sample_rate <= 1):
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if max_grad_norm is not None:
            check_clipping(clipping, max_grad_norm)
        self.noise_multiplier = noise_multiplier  # validated by the setter
        self.max_grad_norm = max_grad_norm if max_grad_norm is None or is_number(max_grad_norm) else list(max_grad_norm)
        self.clipping = clipping
        self._sample_rate = None if sample_rate is None else float(sample_rate)
        self._num_units = None if num_units is None else int(num_units)
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)
        self.accountant: Optional[Accountant] = (
            create_accountant(accountant) if isinstance(accountant, str) else accountant
        )
        self.mechanism = mechanism
        self.sampling = sampling
        #: How each step's batch is selected, as the accountant composes it (Poisson unless the sampler says).
        self.selection = _check_selection(sampling, selection, sample_rate, num_units)
        if self.accountant is not None:
            self.accountant.use_selection(self.selection)  # refuses an accountant that cannot compose it
        self.secure_mode = bool(secure_mode)
        self._divisor = _divisor(expected_batch_size, self._sample_rate, self._num_units, self.bands)
        self.planned_steps = planned_steps
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.steps = len(self.accountant) if self.accountant is not None else 0
        self.unprotected_steps = 0  # steps taken with noise_multiplier 0
        self.draws: Optional[DrawLedger] = DrawLedger() if track_draws else None
        self.passes = 0  # shuffled sampling: passes accounted
        self._closing_passes = 0  # shuffled sampling: passes the step being privatised accounts
        self._set_clipping_options(gamma, adaptive, clipping_stats, unclipped_num_std)
        if sampling == "shuffled":
            self._check_shuffled_plan()
        if self.selection.kind != "poisson":
            self._check_selection_plan()
        if self.strategy is not None and self.counts_unclipped:
            raise ValueError(
                "bandmf noise with a released count of unclipped units (clipping='adaptive' or clipping_stats="
                "'private') is not covered by the amplified banded MF accounting; use clipping='flat' (or "
                "'per_layer', 'automatic') with bandmf"
            )

    def _check_shuffled_plan(self) -> None:
        """Refuse what the per-pass accounting of shuffled batches does not cover."""
        if self.draws is None:
            raise ValueError("sampling='shuffled' needs track_draws=True: passes are counted from the loader's batches")
        if self.strategy is not None:
            raise ValueError("poisson_sampling=False is refused with bandmf noise: it needs cyclic Poisson sampling")
        if self.counts_unclipped:
            raise ValueError(
                "poisson_sampling=False is refused with clipping='adaptive' or clipping_stats='private': the released "
                "count of unclipped units is accounted for Poisson-sampled steps (sensitivity 1/2), not for shuffled "
                "passes. Use poisson_sampling=True, or a fixed clipping bound"
            )

    def _check_selection_plan(self) -> None:
        """Refuse what the accounting of a static-shape selection does not cover."""
        if self.strategy is not None:
            raise ValueError(f"{self.sampling} selection is refused with bandmf noise: the amplified banded MF "
                             "accounting needs b-min-separated cyclic Poisson sampling")
        if self.sampling == "truncated_poisson" and self.draws is None:
            raise ValueError("sampling='truncated_poisson' needs track_draws=True: the draw ledger tells the optimizer "
                             "which rows of a padded batch are padding")

    @property
    def shuffled(self) -> bool:
        """True when the batches are shuffled fixed-size ones, accounted per pass."""
        return self.sampling == "shuffled"

    def _pass_noise_multiplier(self) -> float:
        """The noise multiplier of one pass of shuffled batches: sigma / 2 (replace-one sensitivity 2C)."""
        return self._noise_multiplier / 2.0

    # ------------------------------------------------------------------ construction

    @classmethod
    def for_sampler(cls, batch_sampler: Any, **fields: Any) -> "PrivacyPlan":
        """A plan whose sampling is that of ``batch_sampler`` (a ``PoissonBatchSampler``): its q,
        its draws per epoch and the (global) number of samples it draws from."""
        return cls(**{**sampler_fields(batch_sampler), **fields})

    @classmethod
    def calibrated(
        cls,
        *,
        target_epsilon: float,
        target_delta: float,
        epochs: Optional[float] = None,
        steps: Optional[int] = None,
        **fields: Any,
    ) -> "PrivacyPlan":
        """A plan whose noise multiplier is the smallest that keeps its planned run within
        ``(target_epsilon, target_delta)``: calibrated at exactly the plan's ``sample_rate`` and
        ``planned_steps`` (``steps``, or ``epochs`` passes of ``steps_per_epoch`` draws), with the
        plan's accountant. The GDP approximation is refused (see ``get_noise_multiplier``). Shuffled
        sampling: ``2 sigma`` for the passes the steps span, each a Gaussian at sample rate 1."""
        total = planned_steps(fields.get("steps_per_epoch"), epochs, steps)
        if fields.get("sampling") == "shuffled":
            return cls._calibrated_passes(target_epsilon, target_delta, total, fields)
        strategy = _check_strategy(fields.get("mechanism", "gaussian"), fields.get("strategy"))
        accounted = total if strategy is None else -(-total // strategy.bands)  # bandmf: ceil(n / b)
        sample_rate = fields.get("sample_rate")
        if sample_rate is None:
            raise ValueError("calibrating the noise needs the plan's sample_rate")
        accountant = fields.get("accountant", "pld")
        name = accountant.mechanism if isinstance(accountant, Accountant) else accountant
        sigma = get_noise_multiplier(
            target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=sample_rate, steps=accounted,
            accountant=name, selection=fields.get("selection") or POISSON,
        )
        return cls(noise_multiplier=sigma, planned_steps=total, target_epsilon=target_epsilon,
                   target_delta=target_delta, **fields)

    @classmethod
    def _calibrated_passes(cls, target_epsilon: float, target_delta: float, total: int, fields: Dict[str, Any]) -> "PrivacyPlan":
        passes = -(-total // fields["steps_per_epoch"])
        accountant = fields.get("accountant", "pld")
        name = accountant.mechanism if isinstance(accountant, Accountant) else accountant
        pass_sigma = get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=1.0,
                                          steps=passes, accountant=name)
        return cls(noise_multiplier=2.0 * pass_sigma, planned_steps=total, target_epsilon=target_epsilon,
                   target_delta=target_delta, **fields)

    def _set_clipping_options(self, gamma, adaptive, clipping_stats, unclipped_num_std) -> None:
        clipping = self.clipping
        if gamma is not None and clipping != "automatic":
            raise ValueError(f"gamma is an option of clipping='automatic', not of clipping={clipping!r}")
        if adaptive is not None and clipping != "adaptive":
            raise ValueError(f"adaptive clipping settings were given with clipping={clipping!r}")
        if clipping_stats not in CLIPPING_STATS:
            raise ValueError(f"clipping_stats must be one of {CLIPPING_STATS}, got {clipping_stats!r}")
        if clipping_stats == "private" and clipping == "automatic":
            raise ValueError(
                "clipping_stats='private' counts the units within the clipping bound; automatic clipping has no "
                "bound (every unit is normalised). Use clipping_stats='raw' (not covered by epsilon) or none"
            )
        #: gamma of automatic clipping (None for other modes).
        self.gamma: Optional[float] = None
        if clipping == "automatic":
            if gamma is not None and not (is_number(gamma) and gamma > 0 and math.isfinite(gamma)):
                raise ValueError(f"gamma of automatic clipping must be a finite number > 0, got {gamma!r}")
            self.gamma = DEFAULT_GAMMA if gamma is None else float(gamma)
            if self.max_grad_norm is not None and self.max_grad_norm != 1:
                warnings.warn(
                    f"max_grad_norm={self.max_grad_norm} is not used by automatic clipping: every unit's gradient is "
                    "normalised to norm < 1 and the noise std is noise_multiplier (sensitivity 1). Scale the learning "
                    "rate instead, and pass max_grad_norm=1.0 to silence this warning",
                    UserWarning, stacklevel=4,
                )
        #: Adaptive clipping settings; ``max_grad_norm`` is the current bound, ``initial_max_grad_norm`` the first.
        self.adaptive: Optional[AdaptiveClipping] = None
        self.initial_max_grad_norm = self.max_grad_norm
        if clipping == "adaptive":
            self.adaptive = adaptive if adaptive is not None else AdaptiveClipping()
            if self.max_grad_norm is not None:
                self.adaptive.check_initial(float(self.max_grad_norm))
        self.clipping_stats = clipping_stats
        if unclipped_num_std is not None and not self.counts_unclipped:
            raise ValueError(
                "unclipped_num_std is the noise of the count of unclipped units, released only with "
                "clipping='adaptive' or clipping_stats='private'"
            )
        if unclipped_num_std is not None and not (is_number(unclipped_num_std) and unclipped_num_std > 0
                                                  and math.isfinite(unclipped_num_std)):
            raise ValueError(f"unclipped_num_std must be a finite number > 0, got {unclipped_num_std!r}")
        self.unclipped_num_std = None if unclipped_num_std is None else float(unclipped_num_std)
        if self.counts_unclipped:
            if self.unclipped_num_std is None and not self.expected_batch_size:
                raise ValueError(
                    "adaptive clipping (and private clipping statistics) estimate the unclipped fraction over the "
                    "expected logical batch size: give expected_batch_size (or unclipped_num_std and expected_batch_size)"
                )
            self.gradient_noise_multiplier  # refuses unclipped_num_std <= noise_multiplier / 2 now, not at the first step

    # ------------------------------------------------------------------ mechanism

    @property
    def noise_multiplier(self) -> float:
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        value = check_noise_multiplier(value)
        if getattr(self, "clipping_stats", None) is not None or getattr(self, "adaptive", None) is not None:
            gradient_noise_multiplier(value, self.count_noise_std)  # refuses a sigma the count cannot share
        held = getattr(self, "_noise_multiplier", None)
        if getattr(self, "strategy", None) is not None and getattr(self, "steps", 0) and held != value:
            raise ValueError(
                f"noise_multiplier cannot change from {held} to {value} during a bandmf run: the correlated noise of "
                "the steps in one band window is accounted as one Gaussian of a single noise multiplier. Keep it "
                "constant (or start a new run with its own budget)"
            )
        self._noise_multiplier = value

    @property
    def counts_unclipped(self) -> bool:
        """True when each step releases a noised count of unclipped units (adaptive or private stats)."""
        return self.clipping == "adaptive" or getattr(self, "clipping_stats", None) == "private"

    @property
    def count_noise_std(self) -> Optional[float]:
        """Std of the noise on the count of unclipped units (``unclipped_num_std``, default m / 20), or None."""
        if not self.counts_unclipped:
            return None
        if self.unclipped_num_std is not None:
            return self.unclipped_num_std
        return default_unclipped_num_std(self.expected_batch_size)

    @property
    def gradient_noise_multiplier(self) -> float:
        """The noise multiplier of the clipped sum: ``noise_multiplier``, or with a count released,
        ``(sigma^-2 - (2 sigma_b)^-2)^-1/2`` so that both queries together compose to ``noise_multiplier``."""
        return gradient_noise_multiplier(self._noise_multiplier, self.count_noise_std)

    @property
    def private(self) -> bool:
        """False once a step ran without noise (or when the noise multiplier is 0)."""
        return self._noise_multiplier > 0 and self.unprotected_steps == 0

    @property
    def sample_rate(self) -> Optional[float]:
        """The Poisson rate q every step samples with (public, fixed at construction)."""
        return self._sample_rate

    @property
    def num_units(self) -> Optional[int]:
        """N, the number of privacy units the sampler draws from (public, fixed at construction)."""
        return self._num_units

    @property
    def divisor(self) -> Optional[float]:
        """What the noised clipped sum is divided by under ``loss_reduction="mean"``: a constant fixed when
        the plan is built (given ``expected_batch_size``, else ``sample_rate * num_units / bands``), never
        the size of a drawn batch, so the division is post-processing of the mechanism the accountant
        analyses (docs/privacy.md, "What is public"). None when the plan has neither."""
        return self._divisor

    @property
    def expected_batch_size(self) -> Optional[float]:
        """Expected units per logical batch, the plan's ``divisor``: given, else ``sample_rate * num_units /
        bands`` (bandmf: a step samples one of b partitions at rate q_p), fixed at construction."""
        return self._divisor

    @property
    def sensitivity(self) -> float:
        """Bound on one unit's whole clipped contribution to a step."""
        if self.max_grad_norm is None:
            raise ValueError("this plan has no max_grad_norm")
        return total_norm_bound(self.clipping, self.max_grad_norm)

    @property
    def noise_std(self) -> float:
        """Std of the Gaussian noise added to the clipped sum at each step: sigma * sensitivity
        (``gradient_noise_multiplier * max_grad_norm`` when a count is released too; sigma for automatic clipping)."""
        return self.gradient_noise_multiplier * self.sensitivity

    # ------------------------------------------------------------------ steps (the optimizer)

    def on_draw(self, size: Optional[int], pass_id: Optional[int] = None, new_pass: bool = False,
                padded: Optional[int] = None) -> None:
        """The DP data loader handed a Poisson draw of ``size`` samples to the training loop (shuffled
        batches: a batch of pass ``pass_id``, the pass's first when ``new_pass``; a padded draw: ``size``
        real rows followed by padding up to ``padded`` rows)."""
        if self.draws is not None:
            self.draws.on_draw(size, pass_id, new_pass, padded)
        elif padded is not None:
            raise SamplingMismatchError("a padded draw needs a plan that tracks draws (track_draws=True): only its "
                                        "ledger tells the optimizer which rows are padding")

    def padding_mask(self, rows: int, grouped: bool = False, whole_draw: bool = False) -> Optional[torch.Tensor]:
        """Which rows of the next backward round (of ``rows`` rows) are padding (None: none); see ``DrawLedger``."""
        return None if self.draws is None else self.draws.padding_mask(rows, grouped, whole_draw)

    def on_backward(self, rows: int, grouped: bool = False) -> None:
        """A backward round added the clipped gradients of ``rows`` samples (units when ``grouped``)."""
        if self.draws is not None:
            self.draws.on_backward(rows, grouped)

    def on_discard(self) -> None:
        """The optimizer dropped its held clipped gradients."""
        if self.draws is not None:
            self.draws.on_discard()

    def close_step(self, batch_first: Optional[bool] = None) -> int:
        """Check the step about to be privatised; return how many steps to account (see ``DrawLedger``)."""
        if self.draws is None:
            self._closing = 1
            return 1
        if self.shuffled:  # one step; the passes it begins are accounted by record_steps
            self._closing_passes = self.draws.close_step(sample_rate=self.sample_rate, batch_first=batch_first,
                                                         shuffled=True)
            self._closing = 1
            return 1
        self._closing = self.draws.close_step(sample_rate=self.sample_rate, batch_first=batch_first)
        return self._closing

    @property
    def noise_step_index(self) -> int:
        """The step index (from 0) of the noise added by the step being privatised: the last draw it accounts."""
        return self.steps + self._closing - 1

    def check_partition(self, partition: int, bands: int) -> None:
        """bandmf: a cyclic Poisson draw of ``partition`` (of ``bands``) reaches the training loop.

        Refuses it unless it is the partition of the step it will feed (step index mod b), so that
        every unit's participations stay b-min-separated in the noise steps.
        """
        if self.mechanism != "bandmf":
            return
        if bands != self.bands:
            raise SamplingMismatchError(
                f"the cyclic Poisson loader has {bands} partitions but the banded strategy {self.bands} bands: the "
                "sampling must be b-min-separated with b = bands"
            )
        pending = len(self.draws.sizes) if self.draws is not None else 0
        expected = (self.steps + pending) % self.bands
        if partition != expected:
            raise SamplingMismatchError(
                f"this draw is of partition {partition}, but step {self.steps + pending} of a {self.bands}-banded "
                f"mechanism must take partition {expected}: the loader skipped draws (set_epoch in mid-epoch, an "
                "abandoned iterator) that no step accounted, which would break the b-min-separation the banded MF "
                "accounting relies on. Iterate the loader without skipping batches"
            )

    def record_steps(self, count: int = 1) -> None:
        """Account ``count`` steps at the current noise multiplier and the plan's sample rate
        (shuffled sampling: count the steps, account the passes ``close_step`` found begun)."""
        if count <= 0:
            return
        if self.shuffled:
            self._record_passes(self._closing_passes, count)
            self._closing_passes = 0
            return
        if self._noise_multiplier == 0:
            self.unprotected_steps += count
        elif self.accountant is not None:
            if self.sample_rate is None:
                raise ValueError("this plan has an accountant but no sample_rate to account the step with")
            # bandmf: after T steps the accountant holds ceil(T / b) steps (the theorem's reduction).
            accounted = self._accounted(self.steps + count) - self._accounted(self.steps)
            if accounted:
                self.accountant.step(noise_multiplier=self._noise_multiplier, sample_rate=self.sample_rate,
                                     num_steps=accounted)
        self.steps += count
        horizon = self.strategy.horizon if self.strategy is not None else None
        if horizon is not None and self.steps > horizon and not self._warned_horizon:
            self._warned_horizon = True
            warnings.warn(
                f"step {self.steps} is past the {horizon} steps the banded strategy was optimised for: the privacy "
                "guarantee still holds (a Toeplitz band defines C for any number of steps, column norms <= 1, and "
                "the accountant records ceil(steps / bands) steps), but the noise is no longer optimal for the run",
                UserWarning, stacklevel=3,
            )

    def _record_passes(self, passes: int, steps: int) -> None:
        if self._noise_multiplier == 0:
            self.unprotected_steps += steps
        elif passes and self.accountant is not None:
            self.accountant.step(noise_multiplier=self._pass_noise_multiplier(), sample_rate=1.0, num_steps=passes)
        self.passes += passes
        self.steps += steps

    def _accounted(self, steps: int) -> int:
        """Accountant steps for ``steps`` mechanism steps: ``steps``, or ``ceil(steps / b)`` for bandmf."""
        return -(-steps // self.bands)

    # ------------------------------------------------------------------ privacy spent

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta``: 0 before any step, infinite after a step without noise.

        ``delta`` must be in (0, 1) and below 1/N (see :func:`check_delta_for_units`)."""
        delta = check_delta_for_units(delta, self.num_units)
        if self.unprotected_steps:
            return math.inf
        if self.accountant is None or len(self.accountant) == 0:
            return 0.0
        return self.accountant.get_epsilon(delta)

    def epsilon_after(self, more_steps: int, delta: float) -> float:
        """Epsilon after ``more_steps`` further steps at the current settings (history unchanged)."""
        if more_steps <= 0:
            return self.epsilon(delta)
        if self._noise_multiplier == 0 or self.unprotected_steps:
            return math.inf
        if self.accountant is None or self.sample_rate is None:
            raise ValueError("projecting epsilon needs the plan's accountant and sample_rate")
        if self.shuffled:  # the further steps as new passes (a pass begun counts whole)
            more_passes = -(-more_steps // self.steps_per_epoch)
            return self.accountant.epsilons_after(noise_multiplier=self._pass_noise_multiplier(), sample_rate=1.0,
                                                  steps=[more_passes], delta=delta)[0]
        more_accounted = self._accounted(self.steps + more_steps) - self._accounted(self.steps)
        if more_accounted <= 0:
            return self.epsilon(delta)
        return self.accountant.epsilons_after(
            noise_multiplier=self._noise_multiplier, sample_rate=self.sample_rate, steps=[more_accounted], delta=delta
        )[0]

    def report(self, delta: float) -> Dict[str, Any]:
        """What a model card needs: epsilon, delta, noise, clipping, sampling, steps, accountant."""
        report: Dict[str, Any] = {
            "epsilon": self.epsilon(delta),
            "delta": delta,
            "private": self.private,
            "mechanism": self.mechanism,
            "noise_mechanism": "bandmf" if self.strategy is not None else "independent",
            "noise_multiplier": self._noise_multiplier,
            "max_grad_norm": self.max_grad_norm,
            "clipping": self.clipping,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
            "steps": self.steps,
            "steps_per_epoch": self.steps_per_epoch,
            "accountant": str(self.accountant.mechanism) if self.accountant is not None else None,
            "sampling": self.sampling,
            "secure_mode": self.secure_mode,
        }
        if self.target_epsilon is not None:
            report.update(target_epsilon=self.target_epsilon, target_delta=self.target_delta,
                          planned_steps=self.planned_steps)
        if self.strategy is not None:
            report.update(bands=self.bands, strategy=self.strategy.as_dict(),
                          accounted_steps=self._accounted(self.steps),
                          accounting=("amplified banded MF (Choquette-Choo et al. 2023): Poisson-subsampled Gaussian "
                                      "at the partition rate over ceil(steps / bands) steps"))
        if self.selection.kind != "poisson":
            report.update(adjacency=self.selection.adjacency, accounting=self.selection.describe())
        if self.shuffled:
            report.update(passes=self.passes, adjacency="replace one unit", accounting=(
                "shuffled fixed-size batches, no amplification: each pass one Gaussian of noise multiplier "
                "noise_multiplier / 2 at sample rate 1 (replace-one adjacency, sensitivity 2C)"))
        if self.gamma is not None:
            report["gamma"] = self.gamma
        if self.adaptive is not None:
            report["adaptive_clipping"] = {**self.adaptive.as_dict(), "initial_max_grad_norm": self.initial_max_grad_norm}
        if self.counts_unclipped:
            report.update(gradient_noise_multiplier=self.gradient_noise_multiplier,
                          unclipped_num_std=self.count_noise_std)
        if self.clipping_stats is not None:
            report["clipping_stats"] = self.clipping_stats + (" (not covered by epsilon)" if self.clipping_stats == "raw" else "")
        if not self.private:
            report["note"] = (
                "noise_multiplier=0: clipping only, no differential privacy (epsilon is infinite)"
            )
        elif report["accountant"] == "gdp":
            report["note"] = "epsilon from the GDP central-limit approximation, not a bound"
        return report

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """Plain values (``torch.load(weights_only=True)`` loads them)."""
        return {
            "version": _STATE_VERSION,
            "mechanism": self.mechanism,
            "bands": self.bands,
            "sample_rate": self.sample_rate,
            "steps_per_epoch": self.steps_per_epoch,
            "num_units": self.num_units,
            "sampling": self.sampling,
            "selection": self.selection.as_dict(),
            "passes": self.passes,
            "noise_multiplier": self._noise_multiplier,
            "steps": self.steps,
            "unprotected_steps": self.unprotected_steps,
            "accountant": self.accountant.state_dict() if self.accountant is not None else None,
            "draws": self.draws.state_dict() if self.draws is not None else None,
            **({"max_grad_norm": float(self.max_grad_norm)} if self.adaptive is not None else {}),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the steps, accountant history and pending draws of ``state``.

        Refuses a state whose mechanism or sampling (sample rate, steps per epoch, number of units)
        differs from this plan's: the resumed run would not be the one the history describes. The
        noise multiplier stays this plan's (each recorded step keeps its own in the history).
        """
        for key in ("mechanism", "bands", "sample_rate", "steps_per_epoch", "num_units", "sampling", "selection"):
            saved, mine = state.get(key), getattr(self, key)
            if key == "selection":
                saved, mine = (Selection.from_dict(saved) if saved is not None else None), self.selection
            if saved is not None and mine is not None and saved != mine:
                raise ValueError(
                    f"the checkpoint's privacy plan has {key}={saved}, this run has {mine}: the data, the batch size "
                    "or the sampler changed, so the resumed run would not continue the accounted one. Resume with "
                    "the same data and loader settings."
                )
        if state.get("accountant") is not None and self.accountant is not None:
            self.accountant.load_state_dict(state["accountant"])
        self.steps = int(state["steps"])
        self.passes = int(state.get("passes", 0))
        self.unprotected_steps = int(state.get("unprotected_steps", 0))
        if self.draws is not None and state.get("draws") is not None:
            self.draws.load_state_dict(state["draws"])
        if self.adaptive is not None and state.get("max_grad_norm") is not None:
            self.max_grad_norm = float(state["max_grad_norm"])  # the adapted bound, not the initial one

    def __repr__(self) -> str:
        return (
            f"PrivacyPlan(mechanism={self.mechanism!r}, noise_multiplier={self._noise_multiplier:g}, "
            f"max_grad_norm={self.max_grad_norm}, sample_rate={self.sample_rate}, "
            f"steps_per_epoch={self.steps_per_epoch}, steps={self.steps}, "
            f"accountant={self.accountant.mechanism if self.accountant is not None else None!r})"
        )


__all__ = [
    "MECHANISMS",
    "DrawLedger",
    "PrivacyPlan",
    "SamplingMismatchError",
    "check_delta_for_units",
    "check_noise_multiplier",
    "planned_steps",
    "sampler_fields",
]
