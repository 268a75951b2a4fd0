"""glibc's heap and a private step's peak RSS on the CPU: the mmap threshold, fixed once.

glibc serves a block of at least its *mmap threshold* by ``mmap`` and gives it back to the OS when it
is freed. By default the threshold is dynamic: each such free raises it to the freed block's size (up
to 32 MiB on 64-bit), so later blocks below it come from the heap, whose freed memory the process
keeps. A private step allocates blocks of sizes a plain step does not (float64 norm temporaries,
per-sample gradients, clipped sums); the threshold climbs with them and the heap grows for several
steps. Measured through ``make_private`` with a DP loader (bk, B 16, T 128, 2 threads, 8 steps): peak
RSS 1.16-1.31x the plain step's with the dynamic threshold, 0.95-1.00x with the threshold fixed at
1 MiB, flat after the first steps (docs/performance.md, "Memory through the engine").

Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also ends the dynamic adjustment) is a
setting of the whole process, so it is made once, only on Linux with glibc, and never where the
user chose glibc's settings (any ``MALLOC_*_`` variable) or set ``DPTORCH_KEEP_MALLOC=1``.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: Blocks of at least this size are mmapped and given back when freed (glibc's ``M_MMAP_THRESHOLD``).
MMAP_THRESHOLD = 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_fixed = False


def user_chose_allocator(environ=os.environ) -> bool:
    """Whether the environment sets glibc's malloc tunables or asks dptorch to leave them."""
    return environ.get("DPTORCH_KEEP_MALLOC", "") not in ("", "0") or any(
        k.startswith(("MALLOC_", "GLIBC_TUNABLES")) for k in environ)


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (once per process); whether it is fixed."""
    global _fixed
    if _fixed or not sys.platform.startswith("linux") or user_chose_allocator():
        return _fixed
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to fix
        return False
    _fixed = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _fixed
