"""A controller on a CPU model fixes glibc's mmap threshold once (modes/heap.py), so a large block a
step frees goes back to the OS instead of staying in the heap; never where the user chose glibc's
settings or asked dptorch to leave them."""

import os
import subprocess
import sys
import textwrap

import pytest

from dptorch.grad_sample.modes.heap import user_chose_allocator

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/statm"),
                           reason="glibc's mmap threshold is a Linux matter")

#: Frees a 16 MiB block (glibc's dynamic threshold rises to 16 MiB), then allocates, touches and frees a
#: 12 MiB one, and prints how many MiB of it the process kept.
KEPT_AFTER_FREE = textwrap.dedent("""
    import ctypes, os, sys
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * page / 2**20
    if sys.argv[1] == "attach":
        import torch
        from dptorch.grad_sample import GradSampleHooks
        GradSampleHooks(torch.nn.Linear(2, 2))
    block = libc.malloc(16 << 20); ctypes.memset(block, 1, 16 << 20); libc.free(block)
    before = rss()
    block = libc.malloc(12 << 20); ctypes.memset(block, 1, 12 << 20); libc.free(block)
    print(round(rss() - before))
""")


def kept_mib(how: str, **env) -> int:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "DPTORCH_KEEP"))}
    done = subprocess.run([sys.executable, "-c", KEPT_AFTER_FREE, how], capture_output=True, text=True, timeout=120,
                          env={**environ, **env})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@glibc
def test_attaching_gives_a_freed_large_block_back_to_the_os():
    assert kept_mib("plain") >= 10  # glibc's dynamic threshold: the block came from the heap and stays
    assert kept_mib("attach") <= 1


@glibc
def test_the_users_allocator_choice_is_left_alone():
    assert kept_mib("attach", DPTORCH_KEEP_MALLOC="1") >= 10
    assert kept_mib("attach", MALLOC_ARENA_MAX="2") >= 10


def test_what_counts_as_the_users_choice():
    assert not user_chose_allocator({})
    assert not user_chose_allocator({"DPTORCH_KEEP_MALLOC": "0", "PATH": "/bin"})
    assert user_chose_allocator({"DPTORCH_KEEP_MALLOC": "1"})
    assert user_chose_allocator({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert user_chose_allocator({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"})
