"""A log file in the run directory that a full or failing disk may refuse: the writer goes on.

The job's output (``logs/job.log``) and torchrun's (``logs/torchrun.log``) are copied from a
pipe that must always be drained: a write that fails (ENOSPC, EIO) drops its bytes and
counts them, the next write tries again (a file that cannot even be opened, only after
``retry_seconds``), and when the file takes writes again a line says how much is missing
there. Nothing here raises into the copier.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

RETRY_SECONDS = 1.0
# The line written where output went missing, once the file takes writes again.
GAP_LINE = ("\n=== trainwatch: {dropped} bytes of output are missing here: the log could not "
            "be written ({error}) ===\n")


class BestEffortLog:
    """Appends to ``path``; a failed write costs its bytes (``dropped_bytes``), never the
    writer. ``on_failing(error)`` is called once each time writes start to fail."""

    def __init__(self, path: str | Path, *, retry_seconds: float = RETRY_SECONDS,
                 on_failing: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.retry_seconds = retry_seconds
        self.on_failing = on_failing
        self.dropped_bytes = 0  # in all
        self.error: str | None = None  # why the newest failed write failed
        self._gap = 0  # dropped since the file last took a write
        self._fd: int | None = None
        self._retry_at = 0.0
        self._closed = False
        self._lock = threading.Lock()

    @property
    def failing(self) -> bool:
        return self._gap > 0

    def write(self, data: bytes) -> bool:
        """Append ``data``; False when (some of) it was dropped."""
        if not data:
            return True
        with self._lock:
            newly_failing = self._write(data)
        if newly_failing and self.on_failing is not None:
            try:
                self.on_failing(self.error or "")
            except Exception:  # a report of the failure must not become one
                pass
        return not self._gap

    def close(self) -> None:
        """Close the file for good: later writes are dropped (and not counted)."""
        with self._lock:
            self._closed = True
            self._close_fd()

    def _write(self, data: bytes) -> bool:
        """Append, or drop and count; True when this write began a failing spell."""
        if self._closed:
            return False
        was_failing = self._gap > 0
        if self._fd is None and time.monotonic() < self._retry_at:
            self._drop(len(data))
            return not was_failing
        view = memoryview(data)
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                   | os.O_CLOEXEC, 0o666)
            if self._gap:
                gap = memoryview(GAP_LINE.format(dropped=self._gap, error=self.error).encode())
                while gap:
                    gap = gap[os.write(self._fd, gap):]
                self._gap = 0
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            self.error = exc.strerror or str(exc)
            if self._fd is None:  # not even opened: tried again after the delay
                self._retry_at = time.monotonic() + self.retry_seconds
            self._drop(len(view))
            return not was_failing
        return False

    def _drop(self, size: int) -> None:
        self.dropped_bytes += size
        self._gap += size

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
