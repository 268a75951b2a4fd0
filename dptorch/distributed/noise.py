"""ShardedNoise: Gaussian noise as a function of (seed, step, parameter, element).

Under FSDP2 each rank holds only a slice of every parameter, and the noise must still be drawn
exactly once per element of the *full* parameter: not once per rank (each element would get
``world_size`` draws, a noise std ``sqrt(world_size)`` times too large on the sum... and repeated
draws if the ranks shared a generator), and not only on rank 0 (the other shards would get none).
Rank 0 drawing everything and scattering it would work but materialises a whole parameter's noise
on one rank and costs a scatter per parameter.

Here instead the noise of one logical step is one global stream, cut into fixed chunks of
``chunk_size`` elements per parameter, and each chunk has its own seed derived from
``(step key, parameter index, chunk index)`` (SplitMix64, ``dptorch.data.poisson.draw_seed``).
A rank draws the chunks that overlap its shard and keeps its slice: every element of the full
parameter is drawn once, by the rank that owns it, and its value does not depend on how many
ranks there are or where the shard boundaries fall (a 1-process run draws the same noise). The
step key is drawn from the wrapped :class:`~dptorch.noise.NoiseGenerator` once per step; under
FSDP2 rank 0's key is broadcast to the other ranks (one small collective per step), so the stream
is rank 0's generator, as for DDP, and checkpoints keep working: the generator's state is the
whole state.

With a :class:`~dptorch.noise.SecureNoiseGenerator` each rank draws its slice from its own secure
stream (AES-256-CTR under a key from that process's ``os.urandom``, ``dptorch.noise.secure``):
independent draws, one per element of the full parameter, no key shared between ranks or sent
over the network, nothing replayable (by design). Under DDP only rank 0 draws, as for the default
generator.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch

from dptorch.data.poisson import draw_seed
from dptorch.noise import NoiseGenerator, SecureNoiseGenerator, noise_dtype

DEFAULT_CHUNK = 1 << 20


class ShardedNoise:
    """Per-parameter, per-element Gaussian noise that each rank can draw for its shard only.

    ``base`` is the generator whose state defines the stream: a ``NoiseGenerator`` (default:
    ``NoiseGenerator(seed)``) or a ``SecureNoiseGenerator``. ``noise_like(reference, std)`` draws
    a whole tensor (parameter index 0), so it can stand wherever a noise generator is expected.
    """

    def __init__(
        self,
        base: Union[NoiseGenerator, SecureNoiseGenerator, None] = None,
        *,
        seed: Optional[int] = None,
        chunk_size: int = DEFAULT_CHUNK,
    ) -> None:
        if base is not None and seed is not None:
            raise ValueError("give a base generator or a seed, not both")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if isinstance(base, ShardedNoise):
            base = base.base
        self.base = base if base is not None else NoiseGenerator(seed=seed)
        self.chunk_size = int(chunk_size)
        self._generators: Dict[torch.device, torch.Generator] = {}

    @property
    def secure(self) -> bool:
        return isinstance(self.base, SecureNoiseGenerator)

    def step_key(self) -> Optional[int]:
        """The key of this step's stream (advances the base generator); None for secure noise."""
        if self.secure:
            return None
        generator = self.base.generator
        return int(torch.randint(0, 2**63 - 1, (), generator=generator, device=generator.device).item())

    def slice(
        self,
        key: Optional[int],
        index: int,
        numel: int,
        start: int,
        end: int,
        std: float,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
    ) -> torch.Tensor:
        """Elements ``start:end`` (flat, row-major) of parameter ``index``'s noise (``numel`` elements)."""
        if not 0 <= start <= end <= numel:
            raise ValueError(f"need 0 <= start <= end <= numel, got {start}, {end}, {numel}")
        dtype = noise_dtype(dtype)
        if end == start:
            return torch.zeros(0, dtype=dtype, device=device)
        if self.secure:
            return self.base.noise((end - start,), std, dtype=dtype, device=device)
        generator = self._generator(torch.device(device))
        param_seed = draw_seed(int(key), int(index))
        pieces = []
        size = self.chunk_size
        for chunk in range(start // size, (end - 1) // size + 1):
            chunk_start = chunk * size
            length = min(size, numel - chunk_start)
            generator.manual_seed(draw_seed(param_seed, chunk) & (2**63 - 1))
            values = torch.randn(length, generator=generator, device=device, dtype=dtype)
            pieces.append(values[max(start - chunk_start, 0) : min(end - chunk_start, length)])
        return torch.cat(pieces).mul_(std)

    def noise_like(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        """A whole tensor's noise (one step, parameter index 0)."""
        key = self.step_key()
        flat = self.slice(key, 0, reference.numel(), 0, reference.numel(), std, dtype=reference.dtype,
                          device=reference.device)
        return flat.view(reference.shape)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def state_dict(self) -> Dict[str, Any]:
        """The base generator's state (loadable by the base generator alone, and vice versa)."""
        return self.base.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.base.load_state_dict(state)


__all__ = ["DEFAULT_CHUNK", "ShardedNoise"]
