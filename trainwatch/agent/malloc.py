"""glibc malloc settings for the agent's own process (``trainwatch agent``).

The agent's ~18 threads (scheduler pool, HTTP loop, render pool) each got a malloc arena
of their own (up to 8 a core), and glibc's mmap threshold grows with the largest block
freed, so a /metrics body (1.3 MiB at 256 ranks) and a status file's text were carved
from those heaps and left holes when freed. Two arenas and a fixed 128 KiB threshold
(large blocks are mapped and unmapped whole): peak RSS at 256 simulated ranks 70.1 ->
64.7 MiB, at 64 ranks ~45 -> ~43 MiB (docs/benchmarks.md, the issue #38 agent row).
What the environment sets (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``) wins; other
C libraries (musl) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters (malloc.h)
M_ARENA_MAX = -8
ARENAS = 2
MMAP_THRESHOLD = 128 * 1024
_SETTINGS = ((M_ARENA_MAX, ARENAS, "MALLOC_ARENA_MAX"),
             (M_MMAP_THRESHOLD, MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"))


def tune_malloc() -> dict[str, int]:
    """Apply the settings the environment does not give; what was applied, by the
    variable's name (empty where mallopt is not glibc's). Call before threads start."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):  # musl: no such mallopt parameters
            return {}
    except (OSError, AttributeError):
        return {}
    applied = {}
    for parameter, value, variable in _SETTINGS:
        if variable not in os.environ and mallopt(parameter, value) == 1:
            applied[variable] = value
    return applied
