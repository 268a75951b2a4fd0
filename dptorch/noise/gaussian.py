"""Gaussian noise for DP-SGD.

Dtype: noise is drawn, and returned, in float32 (float64 for a float64 reference), also for
bf16/fp16 references: half precision has too few mantissa bits to represent the Gaussian
faithfully. The caller adds it to the float32 sum of clipped gradients and casts to the
parameter's dtype at the very end (``(summed + noise).to(param.dtype)``).

Default path: torch's generator (``torch.randn``), fast and replayable (on the CPU a draw of more
than 2^20 values is filled in 2^20-value chunks on all threads, each chunk from a generator seeded
by the caller's; the same state gives the same values whatever the thread count). ``NoiseGenerator`` owns
a ``torch.Generator`` whose state (a uint8 tensor) goes into checkpoints, so a resumed run draws
exactly the same noise. Torch's generators (Mersenne Twister on CPU, Philox on CUDA) are not
cryptographically secure: an adversary who recovers the stream can subtract the noise.

Secure path (``secure=True`` / ``SecureNoiseGenerator``): uniform bits come from ``os.urandom``
(the kernel CSPRNG, reseeded by the OS) with no user-visible state, so it cannot be replayed or
checkpointed, by design. Uniforms become normals by Box-Muller in float64. Against the
floating-point attacks on textbook samplers (Mironov 2012 for Laplace; Jin et al. 2022 for
Gaussian samplers in DP libraries), which exploit that the set of floats a sampler can output
is sparse and irregular so that ``value + noise`` reveals ``value``, each noise value is the
sum of ``num_summands`` (default 4) independent draws of std ``std/sqrt(num_summands)``, as
Opacus does. The sum fills the gaps in the support of a single draw; the result is then
rounded from float64 to float32, much coarser than the irregularities of the float64 support.
This is a mitigation, not a proof (a discrete Gaussian, Canonne-Kamath-Steinke 2020, would be
the exact route), and it does nothing against timing side channels. It costs about 4x the
random bytes (32 bytes per noise value) plus the host-side math; see benchmarks/noise.py.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np
import torch

DEFAULT_SECURE_SUMMANDS = 4
_SECURE_CHUNK = 1 << 20  # noise values per os.urandom round (bounds memory: 32 MiB of bytes)
_UNIFORM_STEP = 2.0**-53
_CPU_CHUNK = 1 << 20  # larger CPU draws are filled in chunks of this many values, in parallel


def noise_dtype(reference_dtype: torch.dtype) -> torch.dtype:
    """The dtype noise is drawn in: float64 for float64 references, float32 otherwise."""
    return torch.float64 if reference_dtype == torch.float64 else torch.float32


def _check_std(std: float) -> float:
    std = float(std)
    if not std >= 0.0 or math.isinf(std):
        raise ValueError(f"std must be finite and non-negative, got {std}")
    return std


def gaussian_noise(
    shape_like: torch.Tensor,
    std: float,
    generator: Optional[torch.Generator] = None,
    secure: bool = False,
) -> torch.Tensor:
    """N(0, std^2) noise shaped like ``shape_like``, on its device, in ``noise_dtype`` of it.

    ``generator`` (same device as the reference) makes draws replayable; None uses torch's
    global RNG. ``secure=True`` draws from the OS CSPRNG with the summing mitigation (see the
    module docstring) and cannot take a generator.
    """
    std = _check_std(std)
    dtype = noise_dtype(shape_like.dtype)
    if secure:
        if generator is not None:
            raise ValueError("secure noise uses the OS CSPRNG and takes no generator")
        return secure_gaussian(shape_like.shape, std, device=shape_like.device, dtype=dtype)
    if shape_like.device.type == "cpu" and shape_like.numel() > _CPU_CHUNK:
        return _chunked_cpu_normals(shape_like.shape, dtype, generator).mul_(std)
    noise = torch.randn(shape_like.shape, generator=generator, device=shape_like.device, dtype=dtype)
    return noise.mul_(std)


def _chunked_cpu_normals(shape: torch.Size, dtype: torch.dtype, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Standard normals of ``shape`` on the CPU, in chunks of ``_CPU_CHUNK`` filled side by side.

    torch's CPU ``randn`` runs on one core; a model-sized draw was 10% of a private step. Each chunk
    gets its own generator, seeded by one draw of 62-bit seeds from ``generator`` (or torch's global
    generator), so the values depend on the generator's state and the size only, not on the number
    of threads, and a checkpointed generator replays them exactly.
    """
    out = torch.empty(shape, dtype=dtype)
    chunks = out.view(-1).split(_CPU_CHUNK)
    seeds = torch.randint(0, 2**62, (len(chunks),), generator=generator).tolist()

    def fill(index: int) -> None:
        torch.randn(chunks[index].shape, generator=torch.Generator().manual_seed(seeds[index]), out=chunks[index])

    workers = max(1, min(torch.get_num_threads(), len(chunks)))
    if workers == 1:
        for index in range(len(chunks)):
            fill(index)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(fill, range(len(chunks))))
    return out


def secure_uniforms(count: int) -> np.ndarray:
    """``count`` float64 uniforms in (0, 1] from ``os.urandom``: (top 53 bits + 1) * 2^-53."""
    words = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
    return ((words >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * _UNIFORM_STEP


def secure_bernoulli(count: int, probability: float) -> np.ndarray:
    """``count`` independent booleans, each True with ``probability``, from ``secure_uniforms``.

    A uniform in (0, 1] on a 2^-53 grid is below ``p`` with probability within 2^-53 of ``p``.
    Used by the secure Poisson sampler: membership of each sample in a batch comes from the CSPRNG.
    """
    if count == 0:
        return np.zeros(0, dtype=bool)
    return secure_uniforms(count) < probability


def secure_seed(bits: int = 63) -> int:
    """A non-negative integer of ``bits`` random bits from ``os.urandom`` (a secret seed)."""
    return int.from_bytes(os.urandom((bits + 7) // 8), "little") & ((1 << bits) - 1)


def secure_standard_normals(count: int) -> np.ndarray:
    """``count`` float64 standard normals: Box-Muller on ``secure_uniforms``."""
    pairs = (count + 1) // 2
    uniforms = secure_uniforms(2 * pairs).reshape(2, pairs)
    radius = np.sqrt(-2.0 * np.log(uniforms[0]))
    angle = (2.0 * np.pi) * uniforms[1]
    return np.concatenate((radius * np.cos(angle), radius * np.sin(angle)))[:count]


def secure_gaussian_numpy(count: int, std: float, num_summands: int = DEFAULT_SECURE_SUMMANDS) -> np.ndarray:
    """``count`` float64 N(0, std^2) values, each a sum of ``num_summands`` secure draws."""
    if num_summands < 1:
        raise ValueError(f"num_summands must be >= 1, got {num_summands}")
    out = np.empty(count, dtype=np.float64)
    scale = _check_std(std) / math.sqrt(num_summands)
    for start in range(0, count, _SECURE_CHUNK):
        size = min(_SECURE_CHUNK, count - start)
        draws = secure_standard_normals(num_summands * size).reshape(num_summands, size)
        np.multiply(draws.sum(axis=0), scale, out=out[start : start + size])
    return out


def secure_gaussian(
    shape: Sequence[int],
    std: float,
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    num_summands: int = DEFAULT_SECURE_SUMMANDS,
) -> torch.Tensor:
    """Secure N(0, std^2) tensor of ``shape``: drawn in float64 on the host, then cast and moved."""
    shape = tuple(shape)
    values = secure_gaussian_numpy(math.prod(shape), std, num_summands)
    return torch.from_numpy(values).reshape(shape).to(device=device, dtype=dtype)


class NoiseGenerator:
    """Replayable Gaussian noise from an owned ``torch.Generator`` (default path).

    ``seed=None`` seeds from OS entropy. ``generator=`` adopts an existing ``torch.Generator``
    as it is (Opacus' ``noise_generator=torch.Generator()``; its current state is the stream's
    start, and the noise moves it on). ``state_dict()`` holds the RNG state as a uint8 tensor
    (``torch.load(weights_only=True)`` compatible); loading it restores the stream.
    """

    def __init__(
        self,
        seed: Optional[int] = None,
        device: Union[str, torch.device] = "cpu",
        *,
        generator: Optional[torch.Generator] = None,
    ):
        if generator is not None:
            if seed is not None:
                raise ValueError("give seed= or generator=, not both")
            if not isinstance(generator, torch.Generator):
                raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
            self.generator = generator
            return
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @property
    def device(self) -> torch.device:
        return self.generator.device

    def noise_like(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        if reference.device.type == self.generator.device.type:
            return gaussian_noise(reference, std, generator=self.generator)
        # A generator on another device (Opacus code passes a CPU torch.Generator for a CUDA model):
        # draw where the generator lives, so the stream stays the generator's, then move the noise.
        noise = torch.randn(reference.shape, generator=self.generator, device=self.generator.device,
                            dtype=noise_dtype(reference.dtype))
        return noise.mul_(_check_std(std)).to(reference.device)

    def state_dict(self) -> Dict[str, Any]:
        return {"rng_state": self.generator.get_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.generator.set_state(state["rng_state"].cpu())  # Accelerate may have moved it to the device


def as_noise_generator(source: Any) -> Any:
    """``source`` as an object with ``noise_like``/``state_dict``/``load_state_dict``.

    None stays None (the caller picks its default); a ``torch.Generator`` (Opacus'
    ``noise_generator=``) is adopted by a :class:`NoiseGenerator`; anything with ``noise_like``
    (a ``NoiseGenerator``, a ``SecureNoiseGenerator`` or a custom source) is returned as it is.
    """
    if source is None or hasattr(source, "noise_like"):
        return source
    if isinstance(source, torch.Generator):
        return NoiseGenerator(generator=source)
    raise TypeError(
        f"noise_generator must be a torch.Generator or a dptorch.noise.NoiseGenerator, got {type(source).__name__}"
    )


class SecureNoiseGenerator:
    """Noise from the OS CSPRNG with the summing mitigation; nothing to checkpoint or replay.

    ``state_dict()`` is empty and ``load_state_dict`` accepts only that, so a checkpoint cannot
    silently pretend to restore the noise stream.
    """

    def __init__(self, num_summands: int = DEFAULT_SECURE_SUMMANDS):
        if num_summands < 1:
            raise ValueError(f"num_summands must be >= 1, got {num_summands}")
        self.num_summands = num_summands

    def noise_like(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        return secure_gaussian(
            reference.shape,
            std,
            device=reference.device,
            dtype=noise_dtype(reference.dtype),
            num_summands=self.num_summands,
        )

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError("secure noise has no replayable state; got a non-empty state")


__all__ = [
    "NoiseGenerator",
    "SecureNoiseGenerator",
    "as_noise_generator",
    "gaussian_noise",
    "noise_dtype",
    "secure_gaussian",
    "secure_bernoulli",
    "secure_gaussian_numpy",
    "secure_seed",
    "secure_standard_normals",
    "secure_uniforms",
]
