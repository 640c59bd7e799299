"""The job's output: a pipe the supervisor drains into ``logs/job.log``, best effort, and a
tail it keeps in memory.

A job whose stdout is a file on the run directory's disk dies when that disk fills (its
next ``print`` fails with ENOSPC). The job gets a pipe instead (``OutputPump``); the copy
into ``logs/job.log`` (``BestEffortLog``) drops what a full or failing disk refuses, counts
it, and resumes when space returns. The last ``TAIL_BYTES`` of the output stay in memory,
so a launch failure or a refused input is quoted even when the log lacks it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from trainwatch.process.output_pump import OutputPump, child_pipe
from trainwatch.rundir.best_effort_log import BestEffortLog

TAIL_BYTES = 64 * 1024
# How long a stop or an exit waits for the rest of the job's output (a daemon the job
# left behind may hold its pipe for ever).
DRAIN_SECONDS = 5.0


class JobOutput:
    """The output of every start of one controller's job, in start order."""

    def __init__(self, log_path: Path, *, on_failing: Callable[[str], None] | None = None):
        self.log = BestEffortLog(log_path, on_failing=on_failing)
        self._tail = bytearray()
        self._position = 0  # bytes written so far, the tail's end
        self._lock = threading.Lock()
        self._pump: OutputPump | None = None

    @property
    def position(self) -> int:
        """Where the output is now: ``since(position)`` later is what came after."""
        with self._lock:
            return self._position

    @property
    def dropped_bytes(self) -> int:
        return self.log.dropped_bytes

    def write(self, data: bytes) -> None:
        """Append to the log (best effort) and to the tail."""
        with self._lock:
            self._tail += data
            del self._tail[:-TAIL_BYTES]
            self._position += len(data)
            self.log.write(data)

    def since(self, mark: int) -> bytes:
        """What was written after ``mark``, as much of it as the tail holds."""
        with self._lock:
            return bytes(self._tail[max(0, len(self._tail) - (self._position - mark)):])

    def pipe(self) -> tuple[int, int]:
        """A new start's pipe, ``(read_fd, write_fd)``: the child's stdout is ``write_fd``
        (the caller closes its copy once the child started) and it keeps ``read_fd`` open
        (``pass_fds``) so its writes never meet a broken pipe if the supervisor dies."""
        return child_pipe()

    def pump(self, read_fd: int, name: str) -> None:
        """Drain ``read_fd`` from now on (the previous start's output was drained first)."""
        self._pump = OutputPump(read_fd, self.write, name=name).start()

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Wait until the current start's output has all been copied (its writers closed
        the pipe); False after ``timeout``."""
        pump = self._pump
        return pump is None or pump.drain(timeout)

    def close(self) -> None:
        """Close the log file (the run directory's mount must not stay busy); the tail stays."""
        self.log.close()
