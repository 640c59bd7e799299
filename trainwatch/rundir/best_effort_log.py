"""A log file in the run directory that a full or failing disk may refuse: the writer goes on.

The job's output (``logs/job.log``) and torchrun's (``logs/torchrun.log``) are copied from a
pipe that must always be drained: a write that fails (ENOSPC, EIO) drops its bytes and
counts them, the next write tries again (a file that cannot even be opened, only after
``retry_seconds``), and when the file takes writes again a line says how much is missing
there, followed by the end of what is missing (kept in memory, ``MISSING_TAIL_BYTES``): the
last words of a rank that died while the disk was full reach the log once it has room.
Nothing here raises into the copier.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

RETRY_SECONDS = 1.0
# The line written where output went missing, once the file takes writes again ...
GAP_LINE = ("\n=== trainwatch: {dropped} bytes of output are missing here: the log could not "
            "be written ({error}) ===\n")
# ... then, when it kept them, the last bytes of what is missing (they end where the output
# goes on), under this line.
KEPT_LINE = "=== trainwatch: the last {kept} bytes of the missing output ===\n"
MISSING_TAIL_BYTES = 16 * 1024


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
        self._missing_tail = bytearray()  # the end of those bytes
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
            if self._closed:  # closed while this write hung in its disk
                self._close_fd()
        if newly_failing:
            self._tell(self.error or "")
        return not self._gap

    def _tell(self, error: str) -> None:
        if self.on_failing is not None:
            try:
                self.on_failing(error)
            except Exception:  # a report of the failure must not become one
                pass

    def skip(self, size: int, tail: bytes, why: str) -> None:
        """Count ``size`` bytes that never came here (a writer that fell behind dropped them;
        ``tail``: their end) as missing at this point of the log; ``dropped_bytes`` counts
        only what this log failed to write."""
        if size <= 0:
            return
        with self._lock:
            if self._closed:
                return
            was_failing = self._gap > 0
            self.error = why
            self._gap += size  # counted by the writer that dropped them
            self._keep(tail)
        if not was_failing:
            self._tell(why)

    def settle(self) -> bool:
        """Write the gap's line (and the kept end of what is missing) now, not with the next
        output: the job ended, or went quiet, and its last words belong in the file."""
        with self._lock:
            if self._closed or not self._gap:
                return not self._gap
            if self._fd is None and time.monotonic() < self._retry_at:
                return False
            try:
                self._open()
                self._write_gap()
            except OSError as exc:
                self.error = exc.strerror or str(exc)
                return False
            return True

    def close(self, timeout: float = 1.0) -> None:
        """Close the file for good: later writes are dropped (and not counted). A write
        hung in its disk keeps the file open until it returns; this does not wait for it."""
        self._closed = True
        if self._lock.acquire(timeout=timeout):
            try:
                self._close_fd()
            finally:
                self._lock.release()

    def _write(self, data: bytes) -> bool:
        """Append, or drop and count; True when this write began a failing spell."""
        if self._closed:
            return False
        was_failing = self._gap > 0
        if self._fd is None and time.monotonic() < self._retry_at:
            self._drop(data)
            return not was_failing
        view = memoryview(data)
        try:
            self._open()
            if self._gap:
                self._write_gap()
            while view:
                view = view[os.write(self._fd, view):]  # type: ignore[arg-type]
        except OSError as exc:
            self.error = exc.strerror or str(exc)
            self._drop(view)
            return not was_failing
        return False

    def _open(self) -> None:
        """Open the file unless it is open; one that cannot be opened is tried again only
        after the delay (the callers look first)."""
        if self._fd is not None:
            return
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                               | os.O_CLOEXEC, 0o666)
        except OSError:
            self._retry_at = time.monotonic() + self.retry_seconds
            raise

    def _write_gap(self) -> None:
        """The gap's line and the kept end of what is missing, whole or not at all (a
        partial write of it is cut off by a newline when the next one succeeds)."""
        kept = bytes(self._missing_tail)
        block = GAP_LINE.format(dropped=self._gap, error=self.error).encode()
        if kept:
            block += KEPT_LINE.format(kept=len(kept)).encode() + kept
        view = memoryview(block)
        while view:
            view = view[os.write(self._fd, view):]  # type: ignore[arg-type]
        self._gap = 0
        self._missing_tail = bytearray()

    def _drop(self, data: bytes | memoryview) -> None:
        self.dropped_bytes += len(data)
        self._gap += len(data)
        self._keep(data)

    def _keep(self, tail: bytes | memoryview) -> None:
        self._missing_tail += tail[-MISSING_TAIL_BYTES:]
        del self._missing_tail[:-MISSING_TAIL_BYTES]

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
