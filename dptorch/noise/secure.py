"""The secure random stream: AES-256 in counter mode, keyed from the OS CSPRNG.

A :class:`KeyStream` draws a 256-bit key and a 128-bit starting counter from ``os.urandom`` when it
is made, and again in a process forked from the one that made it, so no two processes (a resumed
run is a new process) and no two streams ever share a key; the key lives in memory only and is
never written to a state dict or a checkpoint (a copied or unpickled stream draws a new key). Its
output is the AES-256-CTR keystream (OpenSSL, through the ``cryptography`` package; AES-NI where
the CPU has it), a pseudorandom function of (key, counter): indistinguishable from uniform bits to
anyone without the key, as ``os.urandom``'s own output is, at a few GB/s instead of a few hundred
MB/s. Each draw reserves its range of counter blocks under a lock (small ones from a reserved
buffer), so draws from several threads never overlap.

From the 64-bit words of the keystream, pure functions make:

- uniforms strictly inside (0, 1): ``(top 52 bits + 1/2) * 2^-52``, exact in float64, never 0
  or 1, so ``log`` is always finite;
- standard normals by Box-Muller in float64 (radius from such a uniform, angle from 52 bits);
- Bernoulli(p) by an exact integer threshold on the whole word: True iff ``word < ceil(p * 2^64)``,
  so P(True) lies in [p, p + 2^-64) with no modulo or rounding bias beyond that.

``fill_normals`` writes ``std * (sum of summands normals) / sqrt(summands)`` into a float32 or
float64 array, computing in float64 and rounding once at the end; the floating-point argument
for that choice is in ``dptorch.noise.gaussian``'s docstring.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any, Optional

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_BLOCK = 16  # bytes per AES block (one counter value)
_COUNTER_MOD = 1 << 128
CHUNK = 1 << 20  # values per piece of a large draw (even, so every piece but the last holds whole pairs)
_BUFFERED = 1 << 14  # words a stream reserves at once for small requests (refilled when short)
_NORMALS = 1 << 16  # standard normals a stream makes at once for small draws
_SMALL = 1 << 14  # draws of at most this many normals take them from that buffer
_STEP = 1 << 13  # pairs per vectorised step (its buffers stay in the cache)
_omp_set_num_threads: Any = None  # torch's libgomp's, once looked up (False: not found)
_zeros: Optional[bytes] = None  # the plaintext the keystream is read through: CHUNK words of zeros


class KeyStream:
    """AES-256-CTR keystream under a key and starting counter from ``os.urandom`` (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rekey()
        _STREAMS.add(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._rekey()

    def __reduce__(self) -> tuple:
        return (KeyStream, ())  # a copy or an unpickled stream gets a fresh key: no key leaves memory

    def _rekey(self) -> None:
        self._key = os.urandom(32)
        self._counter = int.from_bytes(os.urandom(_BLOCK), "big")
        self._pid = os.getpid()
        self._buffer = np.empty(0, dtype=np.uint64)  # reserved keystream not yet handed out
        self._normals = np.empty(0, dtype=np.float64)  # standard normals made from it, not yet handed out

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: never continue the parent's stream
            self._rekey()

    def reserve(self, blocks: int) -> tuple:
        """``(key, first counter)`` of ``blocks`` fresh keystream blocks, never handed out again."""
        with self._lock:
            self._check_process()
            return self._reserve(blocks)

    def _reserve(self, blocks: int) -> tuple:
        start = self._counter
        self._counter = (start + blocks) % _COUNTER_MOD
        return self._key, start

    def words(self, count: int) -> np.ndarray:
        """``count`` fresh uint64 words of keystream (small requests come from a reserved buffer)."""
        if count > _BUFFERED // 4:
            key, counter = self.reserve(_blocks_for_words(count))
            out = np.empty(count + count % 2, dtype=np.uint64)
            keystream_into(key, counter, out)
            return out[:count]
        with self._lock:
            self._check_process()
            if self._buffer.size < count:
                fresh = np.empty(_BUFFERED, dtype=np.uint64)
                keystream_into(*self._reserve(_blocks_for_words(_BUFFERED)), fresh)
                self._buffer = fresh
            out, self._buffer = self._buffer[:count].copy(), self._buffer[count:]
        return out

    def normals(self, count: int) -> np.ndarray:
        """``count <= _SMALL`` fresh float64 standard normals, from a buffer made ``_NORMALS`` at a time."""
        with self._lock:
            self._check_process()
            if self._normals.size < count:
                fresh = torch.empty(_NORMALS, dtype=torch.float64)
                _fill_pieces(*self._reserve(_NORMALS // 2), fresh, 1.0, 1, range(1))
                self._normals = fresh.numpy()
            out, self._normals = self._normals[:count], self._normals[count:]  # never handed out again
        return out


_STREAMS: "weakref.WeakSet[KeyStream]" = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [stream._after_fork() for stream in list(_STREAMS)])


def _blocks_for_words(count: int) -> int:
    return (count + 1) // 2  # two 64-bit words per 128-bit block


def keystream_into(key: bytes, counter: int, out: np.ndarray) -> None:
    """Fill the uint64 array ``out`` (an even number of words) with keystream from block ``counter``."""
    global _zeros
    if _zeros is None:
        _zeros = bytes(8 * CHUNK)
    encryptor = Cipher(algorithms.AES(key), modes.CTR(counter.to_bytes(_BLOCK, "big"))).encryptor()
    target = memoryview(out.view(np.uint8))
    for offset in range(0, out.nbytes, len(_zeros)):  # the encryptor carries the counter on
        size = min(len(_zeros), out.nbytes - offset)
        written = encryptor.update_into(memoryview(_zeros)[:size], target[offset : offset + size])
        if written != size:
            raise RuntimeError(f"AES-CTR wrote {written} of {size} keystream bytes")


def _unit_floats(words: np.ndarray) -> np.ndarray:
    """``1 + (top 52 bits) * 2^-52`` in [1, 2) for uint64 ``words``, made in place by setting the exponent."""
    np.right_shift(words, np.uint64(12), out=words)
    np.bitwise_or(words, np.uint64(0x3FF0000000000000), out=words)
    return words.view(np.float64)


def open_uniforms(words: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Float64 uniforms strictly inside (0, 1) from uint64 ``words`` (consumed): ``(w >> 12 + 1/2) 2^-52``.

    ``[1, 2) - (1 - 2^-53)`` is exact (Sterbenz), so the values are the odd multiples of 2^-53.
    """
    return np.subtract(_unit_floats(words), 1.0 - 2.0**-53, out=out)


def box_muller(radius_words: np.ndarray, angle_words: np.ndarray, scale: float, out: np.ndarray,
               work: np.ndarray, lib: Any = np) -> None:
    """``scale`` times ``2 * len(radius_words)`` float64 standard normals into ``out``: ``r cos(t)``, then ``r sin(t)``.

    ``r = sqrt(-2 log u)`` with ``u`` from :func:`open_uniforms`; ``t = 2 pi k 2^-52`` for the top 52
    bits ``k`` of an angle word. Both word arrays are consumed (shifted in place); ``work`` is float64
    scratch of ``2 * len(radius_words)``. ``lib`` computes the functions: numpy, or torch (about twice
    as fast, on views of the same memory) where :func:`_serial_torch` says its ops stay on this thread.
    """
    pairs = radius_words.size
    radius = open_uniforms(radius_words, work[:pairs])
    angles = np.subtract(_unit_floats(angle_words), 1.0, out=work[pairs : 2 * pairs])
    view = torch.from_numpy if lib is torch else np.asarray
    radius, angles, cosines, sines = map(view, (radius, angles, out[:pairs], out[pairs : 2 * pairs]))
    lib.log(radius, out=radius)
    lib.multiply(radius, -2.0 * scale * scale, out=radius)
    lib.sqrt(radius, out=radius)
    lib.multiply(angles, 2.0 * math.pi, out=angles)
    lib.multiply(lib.cos(angles, out=cosines), radius, out=cosines)
    lib.multiply(lib.sin(angles, out=sines), radius, out=sines)


def _serial_torch(worker: bool) -> bool:
    """Whether torch's ops run on the calling thread alone (then torch, else numpy, does the math).

    On a shared machine torch's OpenMP threads stall each op behind other load (an op of a few
    thousand values took 16 ms instead of 0.1 ms on a loaded 2-core machine). They stay on the
    thread with one torch thread, and in a worker thread of ours after ``omp_set_num_threads(1)``
    on torch's own libgomp (that setting is the calling thread's; the caller's stays as it was).
    """
    global _omp_set_num_threads
    if torch.get_num_threads() == 1:
        return True
    if not worker:
        return False
    if _omp_set_num_threads is None:
        found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
        try:
            _omp_set_num_threads = ctypes.CDLL(found[0]).omp_set_num_threads
        except (IndexError, OSError, AttributeError):
            _omp_set_num_threads = False  # another OpenMP, or none: numpy does the math
    if _omp_set_num_threads is False:
        return False
    _omp_set_num_threads(1)
    return True


def fill_normals(stream: KeyStream, out: torch.Tensor, std: float, summands: int = 1, workers: int = 0) -> None:
    """Fill the flat float32/float64 CPU tensor ``out`` with N(0, std^2) values from ``stream``.

    Each value is ``std / sqrt(summands)`` times a sum of ``summands`` Box-Muller normals, computed in
    float64 and rounded once into ``out``'s dtype. A small draw (a bias, a norm's weight, a LoRA
    factor) takes its normals from the stream's buffer; a large one reserves its whole keystream at
    once and is filled in pieces of ``CHUNK`` values by up to ``workers`` threads (0: torch's
    thread count).
    """
    count = out.numel()
    if summands < 1:
        raise ValueError(f"summands must be >= 1, got {summands}")
    if count == 0:
        return
    scale = float(std) / math.sqrt(summands)
    if count * summands <= _SMALL:
        normals = stream.normals(count * summands).reshape(summands, count)
        np.copyto(out.numpy(), normals.sum(axis=0) * scale if summands > 1 else normals[0] * scale, casting="same_kind")
        return
    pieces = -(-count // CHUNK)
    last = count - (pieces - 1) * CHUNK
    key, first = stream.reserve((pieces - 1) * (CHUNK * summands // 2) + ((last + 1) // 2) * summands)
    workers = max(1, min(int(workers) or torch.get_num_threads(), pieces))
    if torch.get_num_threads() == 1 and workers == 1:
        _fill_pieces(key, first, out, scale, summands, range(pieces))
        return
    bounds = [pieces * worker // workers for worker in range(workers + 1)]
    with ThreadPoolExecutor(workers) as pool:  # threads of our own, even one, so torch can run serially there
        list(pool.map(lambda w: _fill_pieces(key, first, out, scale, summands, range(bounds[w], bounds[w + 1]),
                                             worker=True), range(workers)))


def _fill_pieces(key: bytes, first: int, out: torch.Tensor, scale: float, summands: int, pieces: range,
                 worker: bool = False) -> None:
    """Pieces ``pieces`` of a draw whose keystream starts at block ``first``: see :func:`fill_normals`.

    Piece ``k``'s summand ``j`` reads its words from block ``first + k CHUNK summands / 2 + j pairs``,
    radii in the first half and angles in the second; reused buffers in steps of ``_STEP`` pairs.
    """
    lib = torch if _serial_torch(worker) else np
    flat = out.numpy()
    count = flat.size
    length = min(CHUNK, count + count % 2)
    words = np.empty(length, dtype=np.uint64)
    total = np.empty(length if summands > 1 else 0, dtype=np.float64)
    steps = min(_STEP, (length + 1) // 2)
    values = np.empty(2 * steps, dtype=np.float64)
    work = np.empty(2 * steps, dtype=np.float64)
    for piece in pieces:
        start = piece * CHUNK
        size = min(CHUNK, count - start)
        pairs = (size + 1) // 2
        target = flat[start : start + size] if summands == 1 else total
        for summand in range(summands):
            block = words[: 2 * pairs]
            keystream_into(key, (first + piece * (CHUNK * summands // 2) + summand * pairs) % _COUNTER_MOD, block)
            for low in range(0, pairs, _STEP):
                high = min(low + _STEP, pairs)
                step = high - low
                box_muller(block[low:high], block[pairs + low : pairs + high], scale, values, work, lib)
                sines = min(high, size - pairs) - low  # the last odd value has no sine partner
                if summand == 0:
                    np.copyto(target[low:high], values[:step], casting="same_kind")
                    np.copyto(target[pairs + low : pairs + low + sines], values[step : step + sines], casting="same_kind")
                else:
                    target[low:high] += values[:step]
                    target[pairs + low : pairs + low + sines] += values[step : step + sines]
        if summands > 1:
            np.copyto(flat[start : start + size], total[:size], casting="same_kind")


def bernoulli(stream: KeyStream, count: int, probability: float) -> np.ndarray:
    """``count`` booleans, each True with probability in [p, p + 2^-64): ``word < ceil(p * 2^64)``."""
    p = float(probability)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probability must lie in [0, 1], got {probability}")
    if count == 0 or p == 0.0:
        return np.zeros(count, dtype=bool)
    threshold = math.ceil(Fraction(p) * (1 << 64))
    if threshold >= 1 << 64:
        return np.ones(count, dtype=bool)
    return stream.words(count) < np.uint64(threshold)


__all__ = ["CHUNK", "KeyStream", "bernoulli", "box_muller", "fill_normals", "keystream_into", "open_uniforms"]
