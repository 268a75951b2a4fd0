"""How many torch threads an example uses: one by default, so that its figures do not depend on
the machine or on its load; ``--threads 0`` asks for the CPUs that are idle now."""

from __future__ import annotations

import os
import time


def threads_to_use(requested: int, limit: int = 4) -> int:
    """``requested`` threads, or for 0 the idle CPUs (:func:`idle_cpus`, at most ``limit``)."""
    return requested or idle_cpus(limit)


def idle_cpus(limit: int = 4) -> int:
    """The CPUs this process may use that other processes are not busy with right now, between 1
    and ``limit``. A thread that waits for a busy core stalls the others at every operation (ten
    times slower and more on a shared machine); on an idle one, each core helps. The run is as
    valid as any other, but its numbers then depend on the load: another thread count rounds
    differently, and the noisy training amplifies that."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(limit, cpus - _busy_cpus()))


def _busy_cpus(samples: int = 5) -> int:
    """Tasks of other processes running now: the most seen over a few readings of
    /proc/loadavg's runnable count (which includes this process); elsewhere the 1-minute load."""
    try:
        seen = []
        for _ in range(samples):
            with open("/proc/loadavg") as handle:
                seen.append(int(handle.read().split()[3].split("/")[0]) - 1)
            time.sleep(0.02)
        return max(0, max(seen))
    except (OSError, ValueError, IndexError):
        try:
            return round(os.getloadavg()[0])
        except (AttributeError, OSError):
            return 0
