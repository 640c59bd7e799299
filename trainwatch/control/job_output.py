"""The job's output: a pipe the supervisor drains into ``logs/job.log``, best effort, and a
tail it keeps in memory.

A job whose stdout is a file on the run directory's disk dies when that disk fills (its
next ``print`` fails with ENOSPC). The job gets a pipe instead (``OutputPump``); the copy
into ``logs/job.log`` (``BestEffortLog``) drops what a full or failing disk refuses, counts
it, and resumes when space returns. The pump never waits for the disk: it hands the output
to a bounded queue (``OutputQueue``) whose own thread writes the log, so a hung or slow disk
costs lines (counted), never the job's writes. The last ``TAIL_BYTES`` of the output stay in
memory, filled by the pump itself, so a launch failure, a refused input and the job's last
words are quoted even when the log lacks them.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from trainwatch.process.output_pump import OutputPump, child_pipe
from trainwatch.process.output_queue import OutputQueue
from trainwatch.rundir.best_effort_log import BestEffortLog

TAIL_BYTES = 64 * 1024
# How long a stop or an exit waits for the rest of the job's output (a daemon the job
# left behind may hold its pipe for ever), and then for the log to take it (a hung disk).
DRAIN_SECONDS = 5.0
# The job's last words as the journal and the end of the run quote them, when its log
# lost some of its output.
LAST_WORDS_LINES, LAST_WORDS_CHARS = 20, 4000


class JobOutput:
    """The output of every start of one controller's job, in start order."""

    def __init__(self, log_path: Path, *, on_failing: Callable[[str], None] | None = None):
        self.log = BestEffortLog(log_path, on_failing=on_failing)
        self._queue = OutputQueue(self.log.write, skipped=self.log.skip,
                                  name="tw-job-log-writer")
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
        """Bytes of output missing from the log: refused by its disk, or dropped while the
        log's writer was that far behind."""
        return self.log.dropped_bytes + self._queue.dropped_bytes

    @property
    def error(self) -> str | None:
        """Why output is missing from the log (the newest reason)."""
        return self.log.error or (self._queue.why if self._queue.dropped_bytes else None)

    def write(self, data: bytes) -> None:
        """Append to the tail and queue for the log; never waits for the disk."""
        with self._lock:
            self._tail += data
            del self._tail[:-TAIL_BYTES]
            self._position += len(data)
            self._queue.put(data)

    def last_words(self, mark: int = 0) -> str:
        """The last lines of the output since ``mark`` (from the tail in memory), for the
        journal and the end of the run when the log lost some of it."""
        text = self.since(mark).decode(errors="replace")
        lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
        return "\n".join(lines[-LAST_WORDS_LINES:])[-LAST_WORDS_CHARS:]

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
        """Wait until the current start's output has all been read (its writers closed the
        pipe) and handed to the log, which then writes where output went missing; False
        after ``timeout`` for each (the tail has it all the same)."""
        pump = self._pump
        read = pump is None or pump.drain(timeout)
        self._queue.call(self.log.settle)
        return self._queue.flush(timeout) and read

    def close(self) -> None:
        """Close the log file (the run directory's mount must not stay busy) once it took
        what is queued, or at once if its disk hangs; the tail stays."""
        self._queue.call(self.log.close)
        if not self._queue.close(DRAIN_SECONDS):
            self.log.close()  # the writer hangs in the disk: later writes are dropped
