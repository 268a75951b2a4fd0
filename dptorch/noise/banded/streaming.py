"""BandedNoise: the correlated noise of a banded strategy, drawn step by step with O(b) state.

The noise added at step t is ``(C^{-1} z)_t`` times the noise std, ``z_t`` fresh standard Gaussians
from an inner generator (a :class:`~dptorch.noise.NoiseGenerator` or the secure one). C is
lower-triangular with bands ``c_0..c_{b-1}``, so ``C w = z`` is solved by forward substitution:

    w_t = (z_t - sum_{j=1}^{min(b-1, t)} c_j w_{t-j}) / c_0

which needs only the last ``b - 1`` outputs ``w`` per noised element (a ring buffer). The object
stands where the optimizer's noise generator stands (``noise_like``, ``state_dict``,
``load_state_dict``), so the buffer, the step index and the inner generator's state go into the
optimizer's state dict, and a resumed run draws exactly the noise the uninterrupted one would.

Steps and draws: with a privacy plan attached, the noise of a step is that of the plan's step
index (``PrivacyPlan.noise_step_index``). When the plan accounted several draws for one step (a
draw the loop handed out but never fed to a backward pass), the skipped indices are generated
and dropped, so that the noise index stays the draw's position and the b-min-separation holds in
noise steps, not only in draws.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from dptorch.noise.banded.toeplitz import BandedToeplitz


class BandedNoise:
    """``noise_like(reference, std)``: ``std * (C^{-1} z)_t`` for the next step t (a flat vector).

    ``generator`` draws ``z`` (``noise_like(reference, 1.0)``); ``plan`` (optional) gives the step
    index. The shape of the noised vector must stay the same at every step.
    """

    def __init__(self, strategy: BandedToeplitz, generator: Any, plan: Optional[Any] = None) -> None:
        strategy.check_normalised()
        self.strategy = strategy
        self.generator = generator
        self.plan = plan
        self.index = 0  # noise vectors produced so far (the next one is step `index`)
        self._history: Optional[torch.Tensor] = None  # (b - 1, numel): w_t at row t % (b - 1)
        self._shape: Optional[torch.Size] = None

    @property
    def bands(self) -> int:
        return self.strategy.bands

    @property
    def device(self) -> torch.device:
        return getattr(self.generator, "device", torch.device("cpu"))

    def _target_index(self) -> int:
        if self.plan is None:
            return self.index
        return int(self.plan.noise_step_index)

    def next_unit_noise(self, reference: torch.Tensor) -> torch.Tensor:
        """``w_t = (C^{-1} z)_t`` for the next t, of ``reference``'s shape; advances the state."""
        if self._shape is None:
            self._shape = reference.shape
        elif reference.shape != self._shape:
            raise ValueError(
                f"banded (correlated) noise was drawn for shape {tuple(self._shape)} and is now asked for "
                f"{tuple(reference.shape)}: its state is per noised element, so each step must noise the same "
                "vector (sharded/per-parameter noise and noised clipping counts are not supported with bandmf)"
            )
        z = self.generator.noise_like(reference, 1.0)
        coefficients = self.strategy.coefficients
        t = self.index
        width = self.bands - 1
        if width and self._history is None:
            self._history = torch.zeros((width, z.numel()), dtype=z.dtype, device=z.device)
        w = z.reshape(-1).clone()
        for j in range(1, min(width, t) + 1):
            w.sub_(self._history[(t - j) % width].to(w.device), alpha=coefficients[j])
        w.div_(coefficients[0])
        if width:
            self._history[t % width].copy_(w)
        self.index = t + 1
        return w.view(z.shape)

    def noise_like(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        target = self._target_index()
        if target < self.index:
            raise RuntimeError(
                f"the banded noise is at step {self.index} but the privacy plan at step {target}: the optimizer's "
                "state (which holds the noise state) and the privacy plan come from different points of the run; "
                "restore both from the same checkpoint"
            )
        while self.index < target:  # draws accounted without a step of their own: generate and drop
            self.next_unit_noise(reference)
        return self.next_unit_noise(reference).mul_(float(std))

    def state_dict(self) -> Dict[str, Any]:
        return {
            "mechanism": "bandmf",
            "coefficients": torch.tensor(self.strategy.coefficients, dtype=torch.float64),
            "index": self.index,
            "history": None if self._history is None else self._history.clone(),
            "generator": self.generator.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("mechanism") != "bandmf":
            raise ValueError("this optimizer adds banded (bandmf) noise, but the checkpoint's noise state is not banded")
        saved = tuple(float(c) for c in state["coefficients"].tolist())
        if saved != self.strategy.coefficients:
            raise ValueError(
                f"the checkpoint's banded strategy {saved[:4]}... differs from this run's {self.strategy.coefficients[:4]}"
                "...: resume with the same bands and planned steps"
            )
        self.generator.load_state_dict(state["generator"])
        self.index = int(state["index"])
        history = state.get("history")
        self._history = None if history is None else history.clone()
        if history is not None:
            self._shape = None  # re-learnt at the next step (must match the history's width)

    def __repr__(self) -> str:
        return f"BandedNoise({self.strategy!r}, index={self.index})"


def banded_noise_matrix(strategy: BandedToeplitz, z: torch.Tensor) -> torch.Tensor:
    """Dense reference: ``C^{-1} z`` for ``z`` of shape (n, ...) (n steps), by a triangular solve."""
    n = z.shape[0]
    flat = z.reshape(n, -1).to(torch.float64)
    solved = torch.linalg.solve_triangular(strategy.matrix(n), flat, upper=False)
    return solved.reshape(z.shape)


__all__ = ["BandedNoise", "banded_noise_matrix"]
