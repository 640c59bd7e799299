"""A child's output read from a pipe by a thread, so the child never writes to a disk itself.

A child whose stdout is a file dies of that file's disk: a full one fails its next
``print`` (ENOSPC). Given a pipe instead, its writes only fail when nobody reads: the pump
always drains the pipe and hands each chunk to a sink that may drop it (a full disk's log
costs lines, never the child). ``child_pipe`` makes the pipe; the child may keep its own
read end open (``pass_fds``), so its writes never meet a broken pipe (EPIPE, SIGPIPE) even
when the process that pumps is killed: they fill the pipe's buffer instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from typing import Callable

READ_BYTES = 64 * 1024
# The pipe's buffer (Linux caps it at /proc/sys/fs/pipe-max-size, 1 MiB by default): what a
# child can write while its reader is busy, or gone, before a write waits.
PIPE_BYTES = 1 << 20


def child_pipe() -> tuple[int, int]:
    """``(read_fd, write_fd)``, both close-on-exec, with a buffer of up to PIPE_BYTES."""
    read_fd, write_fd = os.pipe()
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setsize is not None:
        with contextlib.suppress(OSError):  # a lower limit keeps the default (64 KiB)
            fcntl.fcntl(write_fd, setsize, PIPE_BYTES)
    return read_fd, write_fd


class OutputPump:
    """Reads ``read_fd`` until every writer closed it, handing each chunk to ``sink`` (which
    must not raise; what it raises is dropped with the chunk); closes the fd at the end."""

    def __init__(self, read_fd: int, sink: Callable[[bytes], object], *, name: str):
        self.read_fd, self.sink = read_fd, sink
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "OutputPump":
        self._thread.start()
        return self

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the end of the output (every writer gone): False if a
        process still holds the pipe (a daemon the child left behind)."""
        return self.done.wait(timeout)

    def _run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self.read_fd, READ_BYTES)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                try:
                    self.sink(data)
                except Exception:  # the pipe is drained whatever the sink does
                    pass
        finally:
            with contextlib.suppress(OSError):
                os.close(self.read_fd)
            self.done.set()
