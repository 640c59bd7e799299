"""A process's state, CPU times, threads and resident memory from ``/proc/<pid>/stat``
and ``statm``, one plain read each.

psutil reads the same facts from three files (``status`` for the state and threads,
``stat`` for the CPU times, ``statm`` for the resident pages), each through its own
open, buffer and parse, and the agent looks at every local rank's process every few
seconds (at 64 ranks ~13 a second). The kernel writes the state and threads into
``stat`` too, from the same fields (``man 5 proc``), so these reads give the very values
psutil would. The resident pages are taken from ``statm`` as psutil takes them: the rss
field of ``stat`` is another count on recent kernels (6.18 here: the file pages only).
Anything unusual (no such file, a field missing) is left to psutil, which tells a gone
process from a zombie or a denied one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# The kernel's state letter -> the names trainwatch uses (docs/agent.md), as psutil's
# status names map to them in ``procinfo._STATUS``; other letters are "unknown".
STATE_NAMES = {"R": "running", "S": "sleeping", "I": "sleeping", "D": "disk_sleep",
               "T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone", "x": "gone"}


@dataclass(frozen=True, slots=True)
class ProcStat:
    state: str          # trainwatch's name for the kernel's state letter
    cpu_seconds: float  # user + system, as psutil's cpu_times() adds them
    threads: int
    rss_bytes: int
    start_ticks: int    # when it started, in clock ticks after boot: which process this is


def read_small(path: str, limit: int = 4096) -> bytes | None:
    """Up to ``limit`` bytes of a small /proc file in one read, None when unreadable (an
    open() with its buffer and text decoding had cost ~40 µs for a 40-byte file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_proc_stat(pid: int, proc_root: str = "/proc") -> ProcStat | None:
    """The process's facts, or None when the file cannot be read or parsed as the
    kernel writes it (the caller asks psutil then)."""
    data = read_small(f"{proc_root}/{pid}/stat")
    pages = read_small(f"{proc_root}/{pid}/statm")
    if data is None or pages is None:
        return None
    # The command name is in parentheses and may hold spaces and parentheses itself.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        state = fields[0].decode("ascii")
        utime, stime = int(fields[11]), int(fields[12])
        threads, start, rss_pages = int(fields[17]), int(fields[19]), int(pages.split()[1])
    except (IndexError, ValueError, UnicodeDecodeError):
        return None
    return ProcStat(STATE_NAMES.get(state, "unknown"),
                    float(utime) / CLOCK_TICKS + float(stime) / CLOCK_TICKS,
                    threads, rss_pages * PAGE_SIZE, start)
