"""Shared history logic of all accountants: compressed step log, state dicts and caching."""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

from dptorch.accounting.selection import POISSON, Selection
from dptorch.accounting.validation import check_delta, check_noise_multiplier, check_sample_rate, check_steps

#: One run of identical steps: (noise_multiplier, sample_rate, count).
Run = Tuple[float, float, int]

STATE_VERSION = 1


class DeltaResolutionWarning(UserWarning):
    """A numerical (FFT-based) accountant cannot resolve a delta this small: epsilon is infinite."""


def warn_if_unresolved(epsilon: float, delta: float, mechanism: str) -> float:
    """Warn when an FFT-based accountant returns an infinite epsilon; return epsilon unchanged."""
    if math.isinf(epsilon):
        warnings.warn(
            f"the {mechanism!r} accountant finds no finite epsilon at delta={delta:g}: double-precision "
            "FFT accounting resolves delta down to about 1e-13; the 'rdp' accountant works for any delta",
            DeltaResolutionWarning,
            stacklevel=3,
        )
    return epsilon


def merge_runs(history: List[List[Any]] | Tuple[Run, ...]) -> Tuple[Run, ...]:
    """Add up the counts of equal (sigma, q) pairs wherever they occur (composition commutes)."""
    counts: Dict[Tuple[float, float], int] = {}
    for sigma, q, count in history:
        counts[(sigma, q)] = counts.get((sigma, q), 0) + count
    return tuple((sigma, q, count) for (sigma, q), count in counts.items() if count > 0)


class MechanismName(str):
    """An accountant's short name ("rdp"), also callable: Opacus spells it ``accountant.mechanism()``.

    It compares, hashes, formats and serialises (JSON, pickle) as the plain string.
    """

    __slots__ = ()

    def __call__(self) -> str:
        return str(self)

    def __reduce_ex__(self, protocol: Any) -> Tuple[Any, ...]:
        return (str, (str(self),))  # a plain str in pickles: torch.load(weights_only=True) accepts it


class Accountant(ABC):
    """Tracks DP-SGD steps (Poisson-sampled Gaussian mechanism) and converts them to (eps, delta).

    The history is kept compressed: consecutive steps with the same noise multiplier and
    sample rate form one ``[sigma, q, count]`` entry, so long runs cost nothing to store.

    Every step of one accountant selects its batch the same way, ``selection``
    (:mod:`dptorch.accounting.selection`; Poisson unless :meth:`use_selection` says otherwise): an
    accountant composes only the selections named in its ``selections``.
    """

    #: Short name of the accounting method ("pld", "prv", "rdp", "gdp"); a :class:`MechanismName`,
    #: so Opacus' ``accountant.mechanism()`` works too.
    mechanism: ClassVar[str] = MechanismName("")
    #: The batch selections (``Selection.kind``) this accountant can compose.
    selections: ClassVar[Tuple[str, ...]] = ("poisson",)
    _selection: Selection = POISSON  # (a class default too: a subclass may skip this __init__)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("mechanism")
        if isinstance(name, str) and not isinstance(name, MechanismName):
            cls.mechanism = MechanismName(name)

    def __init__(self) -> None:
        self._history: List[List[Any]] = []
        self._epsilon_cache: Dict[Any, float] = {}
        self._selection = POISSON

    # -- batch selection -------------------------------------------------------------------

    @property
    def selection(self) -> Selection:
        """How every recorded step selected its batch (Poisson unless ``use_selection`` set another)."""
        return self._selection

    def use_selection(self, selection: Selection) -> None:
        """Account every step as selecting its batch by ``selection``; refused when this accountant cannot
        compose it, or when steps of another selection are recorded already."""
        self._check_supported(selection)
        if self._history and selection != self._selection:
            raise ValueError(
                f"this accountant holds {len(self)} steps of {self._selection.kind} selection; steps of "
                f"{selection.kind} selection cannot join them (one accountant composes one selection)"
            )
        self._selection = selection
        self._epsilon_cache.clear()

    def _check_supported(self, selection: Selection) -> None:
        if selection.kind in self.selections:
            return
        able = sorted({repr(str(kind.mechanism)) for kind in _descendants(Accountant)
                       if selection.kind in getattr(kind, "selections", ())})
        raise ValueError(
            f"the {self.mechanism!r} accountant cannot account {selection.kind} batch selection ("
            f"{selection.describe()}); it is accounted by the {' or '.join(able) or 'no'} accountant: build the "
            f"PrivacyEngine with accountant={able[0] if able else '...'}"
        )

    # -- recording -------------------------------------------------------------------------

    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` steps with noise multiplier sigma and Poisson sample rate q."""
        sigma = check_noise_multiplier(noise_multiplier)
        q = self._selection.check_sample_rate(check_sample_rate(sample_rate))
        count = check_steps(num_steps, "num_steps")
        if count == 0:
            return
        if self._history and self._history[-1][0] == sigma and self._history[-1][1] == q:
            self._history[-1][2] += count
        else:
            self._history.append([sigma, q, count])
        self._epsilon_cache.clear()

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """Opacus' hook: ``optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(q))``.

        Each time the optimizer takes a (real) step the hook records it at the optimizer's current
        ``noise_multiplier``: as many steps of rate ``sample_rate`` as the DPOptimizer says it
        accounts (``steps_to_account()``: one per Poisson draw; a step after several backward passes
        with no record of their draws is refused by it before anything changes), or, for an optimizer
        that is not dptorch's, one step at ``sample_rate`` times ``accumulated_iterations``, as in Opacus. ``PrivacyEngine`` needs no such hook: its
        optimizer reports every step to the engine's accountant.
        """
        rate = check_sample_rate(sample_rate)

        def hook_fn(optimizer: Any) -> None:
            if hasattr(optimizer, "steps_to_account"):
                steps, factor = optimizer.steps_to_account()
            else:
                steps, factor = 1, getattr(optimizer, "accumulated_iterations", 1)
            self.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=rate * factor, num_steps=steps)

        hook_fn.records_privacy = True  # the optimizer refuses, before it steps, a step this hook could only guess
        return hook_fn

    @property
    def history(self) -> List[List[Any]]:
        """A copy of the compressed history: a list of ``[sigma, q, count]``."""
        return [list(entry) for entry in self._history]

    @history.setter
    def history(self, entries: List[Any]) -> None:
        """Replace the history by ``entries`` (``(sigma, q, count)`` each, checked), as Opacus' attribute allows."""
        self.load_state_dict({"mechanism": str(self.mechanism), "history": list(entries)})

    def __len__(self) -> int:
        return sum(entry[2] for entry in self._history)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={len(self)}, runs={len(self._history)})"

    # -- privacy ---------------------------------------------------------------------------

    def get_epsilon(self, delta: float) -> float:
        """Epsilon of all recorded steps at the given delta (0.0 before the first step)."""
        delta = check_delta(delta)
        if not self._history:
            return 0.0
        key = ("epsilon", delta)
        if key not in self._epsilon_cache:
            # at a delta above the total variation distance an accountant may find a negative epsilon: 0 holds there
            self._epsilon_cache[key] = max(0.0, float(self._compute_epsilon(merge_runs(self._history), delta)))
        return self._epsilon_cache[key]

    def epsilons_after(
        self, *, noise_multiplier: float, sample_rate: float, steps: Sequence[int], delta: float
    ) -> List[float]:
        """Epsilon after each of ``steps`` more steps at (sigma, q), on top of the recorded history.

        The history itself is left unchanged (a projection, e.g. for a curve against steps).
        """
        sigma = check_noise_multiplier(noise_multiplier)
        q = self._selection.check_sample_rate(check_sample_rate(sample_rate))
        counts = [check_steps(count, "steps") for count in steps]
        delta = check_delta(delta)
        return self._epsilons_after(sigma, q, counts, delta)

    def _epsilons_after(self, sigma: float, q: float, counts: List[int], delta: float) -> List[float]:
        epsilons = []
        for count in counts:
            runs = merge_runs(self._history + [[sigma, q, count]])
            epsilons.append(max(0.0, float(self._compute_epsilon(runs, delta))) if runs else 0.0)
        return epsilons

    @abstractmethod
    def _compute_epsilon(self, runs: Tuple[Run, ...], delta: float) -> float:
        """Epsilon of the composition of ``runs`` (non-empty, equal pairs merged) at ``delta``."""

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self, destination: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Plain Python state (str, int, float, lists) that ``torch.load(weights_only=True)`` accepts; written
        into ``destination`` (and returned) when given, as Opacus' ``state_dict(destination)`` does."""
        state = {
            "mechanism": str(self.mechanism),  # a plain str: weights_only loads no str subclass
            "version": STATE_VERSION,
            "history": [[float(sigma), float(q), int(count)] for sigma, q, count in self._history],
        }
        if self._selection != POISSON:  # a Poisson state stays as it was (Opacus reads it)
            state["selection"] = self._selection.as_dict()
        if destination is None:
            return state
        destination.update(state)
        return destination

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Replace the history and the batch selection by those in ``state_dict`` (as made by :meth:`state_dict`)."""
        if not isinstance(state_dict, dict) or "history" not in state_dict:
            raise ValueError("state_dict must be a dict with a 'history' entry, as made by Accountant.state_dict()")
        mechanism = state_dict.get("mechanism", self.mechanism)
        if mechanism != self.mechanism:
            raise ValueError(
                f"state_dict was saved by a {mechanism!r} accountant and cannot be loaded into a "
                f"{self.mechanism!r} one; use dptorch.accounting.accountant_from_state_dict(state_dict)"
            )
        selection = Selection.from_dict(state_dict.get("selection"))
        self._check_supported(selection)
        history: List[List[Any]] = []
        for index, entry in enumerate(state_dict["history"]):
            if len(entry) != 3:
                raise ValueError(f"history[{index}] must be [sigma, q, count], got {entry!r}")
            sigma = check_noise_multiplier(entry[0], f"history[{index}] noise_multiplier")
            q = selection.check_sample_rate(check_sample_rate(entry[1], f"history[{index}] sample_rate"))
            count = check_steps(entry[2], f"history[{index}] count")
            if count:
                history.append([sigma, q, count])
        self._history = history
        self._selection = selection
        self._epsilon_cache.clear()


def _descendants(cls: type) -> list:
    """Every subclass of ``cls``, at any depth (the accountants defined so far: importing this module
    imports the package, which defines them all)."""
    out = []
    for sub in cls.__subclasses__():
        out += [sub] + _descendants(sub)
    return out
