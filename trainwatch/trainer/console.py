"""A rank's stdout and stderr that a full disk cannot fail.

The launcher has torchrun write each rank's output to its own files under
``RUN_DIR/logs/torchrun/`` (``--redirects``): on a full disk the rank's next ``print``
fails with ENOSPC and the exception kills a healthy rank (and the interpreter's last flush
would turn its exit code into 120). ``guard_console`` puts writers in front of both that
drop what cannot be written, count it, and try again with the next line, so output
resumes when space returns.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Callable


class _GuardedFd(io.RawIOBase):
    """A raw writer on ``fd`` whose failed writes are dropped and counted, never raised."""

    def __init__(self, fd: int, guard: "ConsoleGuard"):
        super().__init__()
        self._fd, self._guard = fd, guard
        self.failing = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            first, self.failing = not self.failing, True
            self._guard.dropped(len(view), exc, first=first)
            return size
        self.failing = False
        return size


class ConsoleGuard:
    """What the guarded console dropped. ``on_failing(why)`` is called once each time a
    stream's writes start to fail (not for every line: it may write to that stream)."""

    def __init__(self) -> None:
        self.dropped_bytes = 0
        self.on_failing: Callable[[str], None] | None = None

    def dropped(self, size: int, exc: OSError, *, first: bool) -> None:
        self.dropped_bytes += size
        if first and self.on_failing is not None:
            try:
                self.on_failing(f"console output dropped ({exc.strerror or exc})")
            except Exception:
                pass


def guard_console() -> ConsoleGuard:
    """Replace ``sys.stdout`` and ``sys.stderr`` (those with a file descriptor) by guarded
    writers on the same descriptors, line-buffered, same encoding."""
    guard = ConsoleGuard()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
        raw = _GuardedFd(fd, guard)
        setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw), encoding=stream.encoding,
                                            errors=stream.errors, line_buffering=True,
                                            write_through=True))
    return guard
