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

Secure path (``secure=True`` / ``SecureNoiseGenerator``): bits from ``dptorch.noise.secure`` (the
AES-256-CTR keystream under a key from ``os.urandom``, fresh per process and per generator, never
in a checkpoint), so the stream cannot be replayed or recovered from any saved state, by design.
Each value is one Box-Muller draw in float64 (radius from a 52-bit uniform strictly inside (0, 1),
angle from 52 bits), multiplied by ``std`` in float64 and rounded once to float32; the float32
noise is then added to the float32 sum of clipped gradients.

Floating-point attacks: Mironov (2012) showed that Laplace noise from a textbook sampler in
doubles takes only a sparse, irregular set of values, so the set of possible ``x + noise`` depends
on ``x`` and one output can rule a neighbouring dataset out; Jin et al. (2022) found the same for
the Gaussian samplers of DP libraries (Box-Muller among them). This path defends against that
support ("hole") attack on float32 noise by resolution: its grid of (radius, angle) inputs is
about 2^28 times finer than float32's spacing, so a float32 value ``v`` receives the Gaussian mass
of its rounding interval up to a relative grid-counting error of order ``2^-29 std/|v|`` (an
estimate: of order 2^-9 at ``|v| = 2^-20 std``; all but about 1e-6 of the draws lie above that),
no float32 value within 8.5 std is impossible except within about 2^-70 std of zero, and the
low-order mantissa bits are uniform (``tests/noise/test_secure_float_bits.py`` checks them).
Summing draws (Opacus' mitigation, and this path's before) fills gaps at float64 resolution that
the rounding to float32 throws away, so for float32 noise it bought nothing for its 4x cost; for
float64 noise (a float64 model), where no coarser rounding follows, ``secure_summands`` keeps the
sum of ``DEFAULT_SECURE_SUMMANDS`` = 4 draws of std ``std/2``. Still open: this is an argument,
not a proof of (epsilon, delta) in floating point (no value beyond ``sqrt(106 ln 2)`` = 8.57 std
occurs, a Gaussian mass of about 1e-17, and the float32 addition rounds); the exact route would be
a discrete Gaussian on an integer grid (Canonne-Kamath-Steinke 2020), not implemented; timing
side channels are out of scope (the math has no value-dependent branches, but nothing is
constant-time by construction). The cost is 2.4x to 3.0x the default path on a quiet 2-core CPU
(benchmarks/noise.py; docs/privacy.md has the figures).
"""

from __future__ import annotations

import bisect
import math
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Optional, Sequence, Union

import numpy as np
import torch

from dptorch.noise.secure import KeyStream, bernoulli, fill_normals, open_uniforms

DEFAULT_SECURE_SUMMANDS = 4  # summands of secure float64 noise (float32 noise takes one draw, see above)
_STREAM = KeyStream()  # this process's secure stream (a forked child rekeys it before its first draw)
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


def add_gaussian_noise_(targets: Sequence[torch.Tensor], std: float, generator: Optional[torch.Generator] = None) -> None:
    """Add to ``targets`` (contiguous, of one device and float dtype) the noise ``gaussian_noise`` draws for
    their flat concatenation, in place: the same values, added element by element.

    A CPU draw of more than ``_CPU_CHUNK`` values is drawn and added chunk by chunk on the threads, so
    the noise never takes memory of the targets' size (a model-sized buffer at the step).
    """
    std = _check_std(std)
    flats = [t.view(-1) for t in targets]
    numel = sum(t.numel() for t in flats)
    if not flats:
        return
    if flats[0].device.type != "cpu" or numel <= _CPU_CHUNK:
        reference = torch.zeros(1, dtype=flats[0].dtype, device=flats[0].device).expand(numel)
        add_flat_noise_(flats, gaussian_noise(reference, std, generator))
        return
    starts = [0]
    for flat in flats:
        starts.append(starts[-1] + flat.numel())
    # One chunk buffer per worker, made here: what a worker thread allocates stays in its own malloc arena,
    # resident after the step.
    buffers: "queue.SimpleQueue[torch.Tensor]" = queue.SimpleQueue()
    for _ in range(_workers(numel)):
        buffers.put(torch.empty(_CPU_CHUNK, dtype=noise_dtype(flats[0].dtype)))

    def add(span: slice, chunk_generator: torch.Generator) -> None:
        buffer = buffers.get()
        noise = torch.randn(span.stop - span.start, generator=chunk_generator, out=buffer[:span.stop - span.start]).mul_(std)
        k = bisect.bisect_right(starts, span.start) - 1  # the first target the chunk reaches
        while k < len(flats) and starts[k] < span.stop:
            low, high = max(span.start, starts[k]), min(span.stop, starts[k + 1])
            flats[k][low - starts[k]:high - starts[k]].add_(noise[low - span.start:high - span.start])
            k += 1
        buffers.put(buffer)

    _for_each_chunk(numel, generator, add)


def add_flat_noise_(targets: Sequence[torch.Tensor], noise: torch.Tensor) -> None:
    """Add the flat ``noise`` to the flat ``targets``, in their order (one fused call)."""
    if targets:
        torch._foreach_add_(list(targets), list(noise.reshape(-1).split([t.numel() for t in targets])))


def _chunked_cpu_normals(shape: torch.Size, dtype: torch.dtype, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Standard normals of ``shape`` on the CPU, in chunks of ``_CPU_CHUNK`` filled side by side (``_for_each_chunk``)."""
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    _for_each_chunk(flat.numel(), generator,
                    lambda span, chunk_generator: torch.randn(span.stop - span.start, generator=chunk_generator, out=flat[span]))
    return out


def _for_each_chunk(numel: int, generator: Optional[torch.Generator], draw: Callable[[slice, torch.Generator], Any]) -> None:
    """``draw(span, chunk_generator)`` for each ``_CPU_CHUNK``-value span of ``range(numel)``, side by side on the threads.

    torch's CPU ``randn`` runs on one core; a model-sized draw was 10% of a private step. Each chunk
    gets its own generator, seeded by one draw of 62-bit seeds from ``generator`` (or torch's global
    generator), so the values depend on the generator's state and the size only, not on the number
    of threads, and a checkpointed generator replays them exactly.
    """
    count = -(-numel // _CPU_CHUNK)
    seeds = torch.randint(0, 2**62, (count,), generator=generator).tolist()

    def run(index: int) -> None:
        span = slice(index * _CPU_CHUNK, min(numel, (index + 1) * _CPU_CHUNK))
        draw(span, torch.Generator().manual_seed(seeds[index]))

    workers = _workers(numel)
    if workers == 1:
        for index in range(count):
            run(index)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, range(count)))


def _workers(numel: int) -> int:
    """Threads a chunked draw of ``numel`` values runs on."""
    return max(1, min(torch.get_num_threads(), -(-numel // _CPU_CHUNK)))


def secure_summands(dtype: torch.dtype) -> int:
    """Draws summed per secure noise value: 1 for float32 noise, ``DEFAULT_SECURE_SUMMANDS`` for float64."""
    return DEFAULT_SECURE_SUMMANDS if dtype == torch.float64 else 1


def secure_uniforms(count: int) -> np.ndarray:
    """``count`` float64 uniforms strictly inside (0, 1) from the secure stream (``secure.open_uniforms``)."""
    return open_uniforms(_STREAM.words(count), np.empty(count, dtype=np.float64))


def secure_bernoulli(count: int, probability: float) -> np.ndarray:
    """``count`` independent booleans, each True with ``probability`` (to within 2^-64), from the secure stream.

    Used by the secure Poisson samplers: membership of each sample in a batch comes from the CSPRNG.
    """
    return bernoulli(_STREAM, count, probability)


def secure_subset(count: int, size: int) -> np.ndarray:
    """``size`` distinct indices of ``range(count)``, a uniformly random subset in random order, from the secure
    stream: a partial Fisher-Yates shuffle whose picks are words modulo the remaining count (each within
    ``count * 2^-64`` of uniform). Used by the secure fixed-size and truncated Poisson samplers."""
    if not 0 <= size <= count:
        raise ValueError(f"cannot choose {size} of {count} indices")
    words = _STREAM.words(size)
    moved: dict = {}  # position -> the index now there (positions not in it hold themselves)
    chosen = np.empty(size, dtype=np.int64)
    for i in range(size):
        j = i + int(words[i] % np.uint64(count - i))
        chosen[i] = moved.get(j, j)
        moved[j] = moved.get(i, i)
    return chosen


def secure_seed(bits: int = 63) -> int:
    """A non-negative integer of ``bits`` random bits from ``os.urandom`` (a secret seed)."""
    return int.from_bytes(os.urandom((bits + 7) // 8), "little") & ((1 << bits) - 1)


def secure_standard_normals(count: int) -> np.ndarray:
    """``count`` float64 standard normals (one Box-Muller draw each) from the secure stream."""
    return secure_gaussian_numpy(count, 1.0, num_summands=1)


def secure_gaussian_numpy(count: int, std: float, num_summands: int = DEFAULT_SECURE_SUMMANDS) -> np.ndarray:
    """``count`` float64 N(0, std^2) values, each a sum of ``num_summands`` secure draws."""
    if num_summands < 1:
        raise ValueError(f"num_summands must be >= 1, got {num_summands}")
    out = torch.empty(count, dtype=torch.float64)
    fill_normals(_STREAM, out, _check_std(std), num_summands)
    return out.numpy()


def secure_gaussian(
    shape: Sequence[int],
    std: float,
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    num_summands: Optional[int] = None,
    stream: Optional[KeyStream] = None,
) -> torch.Tensor:
    """Secure N(0, std^2) tensor of ``shape`` from ``stream`` (default: the process's).

    Drawn on the host in float64, rounded once to float32 (or kept in float64, ``noise_dtype`` of
    ``dtype``), then moved: for a CUDA device through pinned memory with an asynchronous copy.
    ``num_summands=None`` takes ``secure_summands`` of that dtype.
    """
    shape = tuple(shape)
    draw_dtype = noise_dtype(dtype)
    summands = secure_summands(draw_dtype) if num_summands is None else int(num_summands)
    if summands < 1:
        raise ValueError(f"num_summands must be >= 1, got {num_summands}")
    device = torch.device(device)
    host = torch.empty(shape, dtype=draw_dtype, pin_memory=device.type == "cuda")
    fill_normals(stream if stream is not None else _STREAM, host.view(-1), _check_std(std), summands)
    return host.to(device=device, dtype=dtype, non_blocking=True)


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


def add_noise_(targets: Sequence[torch.Tensor], std: float, source: Any) -> None:
    """Add ``source.noise_like(reference, std)`` for the flat concatenation of ``targets`` to them in place.

    A ``NoiseGenerator`` whose ``noise_like`` is its own (not overridden) draws with
    ``add_gaussian_noise_`` where its generator lives: the same values, and on the CPU no buffer of the
    targets' size. Any other source's ``noise_like`` is called once, for all of them.
    """
    if not targets:
        return
    own = isinstance(source, NoiseGenerator) and getattr(source.noise_like, "__func__", None) is NoiseGenerator.noise_like
    if own and targets[0].device.type == source.generator.device.type:
        add_gaussian_noise_(targets, std, source.generator)
        return
    reference = torch.zeros(1, dtype=targets[0].dtype, device=targets[0].device).expand(sum(t.numel() for t in targets))
    add_flat_noise_([t.view(-1) for t in targets], source.noise_like(reference, std))


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
    """Noise from its own secure stream (AES-256-CTR keyed from ``os.urandom``); nothing to replay.

    Each generator, and each copy or unpickled one, has a fresh key. ``state_dict()`` is empty and
    ``load_state_dict`` accepts only that, so a checkpoint holds no secret and cannot silently pretend
    to restore the noise stream: a resumed run draws from a new key. ``num_summands=None`` takes
    ``secure_summands`` of the noise dtype.
    """

    def __init__(self, num_summands: Optional[int] = None):
        if num_summands is not None and num_summands < 1:
            raise ValueError(f"num_summands must be >= 1, got {num_summands}")
        self.num_summands = num_summands
        self.stream = KeyStream()

    def noise(self, shape: Sequence[int], std: float, *, dtype: torch.dtype = torch.float32,
              device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """N(0, std^2) of ``shape``, in ``noise_dtype(dtype)``, on ``device``."""
        return secure_gaussian(shape, std, device=device, dtype=noise_dtype(dtype), num_summands=self.num_summands,
                               stream=self.stream)

    def noise_like(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        return self.noise(reference.shape, std, dtype=reference.dtype, device=reference.device)

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError("secure noise has no replayable state; got a non-empty state")


__all__ = [
    "NoiseGenerator",
    "add_gaussian_noise_",
    "add_noise_",
    "SecureNoiseGenerator",
    "as_noise_generator",
    "gaussian_noise",
    "noise_dtype",
    "secure_gaussian",
    "secure_bernoulli",
    "secure_gaussian_numpy",
    "secure_seed",
    "secure_standard_normals",
    "secure_subset",
    "secure_summands",
    "secure_uniforms",
]
