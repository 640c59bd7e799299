"""Storage probes: mounts, block-device counters and a timed write probe.

Shared by the agent's storage collector and preflight's storage checks; callers run
them behind a ``Deadline`` (a hung mount must not hang them).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

SECTOR = 512


def parse_mounts(text: str) -> list[tuple[str, str, str, str]]:
    """(source, mountpoint, fstype, options) from /proc/self/mounts text (octal escapes)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            unescape = lambda s: s.encode().decode("unicode_escape")  # noqa: E731
            out.append((unescape(parts[0]), unescape(parts[1]), parts[2], parts[3]))
    return out


def mount_of(path: str, mounts: list[tuple[str, str, str, str]]):
    """The mount entry with the longest mountpoint containing ``path``."""
    best = None
    for entry in mounts:
        point = entry[1].rstrip("/") or "/"
        if path == point or path.startswith(point.rstrip("/") + "/") or point == "/":
            if best is None or len(point) > len(best[1].rstrip("/") or "/"):
                best = entry
    return best


def parse_diskstats(text: str) -> dict[str, dict[str, float]]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 14:
            continue
        try:
            out[parts[2]] = {"read_bytes": int(parts[5]) * SECTOR,
                             "written_bytes": int(parts[9]) * SECTOR,
                             "io_seconds": int(parts[12]) / 1000.0}
        except ValueError:
            continue
    return out


def write_probe(path: str, size: int, node: str) -> float:
    """Write, fsync, read back and remove a small file; returns seconds taken."""
    started = time.perf_counter()
    name = Path(path, f".trainwatch-probe-{node}-{os.getpid()}")
    payload = os.urandom(size)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = os.write(fd, payload)
        if written != size:
            raise OSError(errno.ENOSPC, "short write")
        os.fsync(fd)
    finally:
        os.close(fd)
        try:
            data = name.read_bytes()
        finally:
            try:
                name.unlink()
            except OSError:
                pass
    if data != payload:
        raise OSError(errno.EIO, "read back different bytes")
    return time.perf_counter() - started
