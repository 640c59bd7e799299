"""A pipe's output handed to a slow writer by a thread of its own, with a bounded backlog.

A pump that writes what it reads to a file stops reading while that write waits (a hung
NFS server, a frozen or saturated disk), and once the pipe's buffer is full the child at
its other end waits too: a stuck log would stall the training job. The pump puts each
chunk here instead, which never waits on I/O: a thread hands the chunks to the writer in
order; while more than ``max_bytes`` wait, new chunks are dropped and counted, and the
writer hears of them (``skipped``) in their place, so its log can say where output went
missing and keep the end of what did (the last words of a rank that died meanwhile).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Union

# What may wait for a slow writer before chunks are dropped (the pipe's 1 MiB buffer comes
# on top): minutes of a chatty job's output, a bounded cost in memory.
MAX_QUEUED_BYTES = 8 << 20
# The end of a dropped stretch kept for ``skipped``: a traceback's worth.
SKIPPED_TAIL_BYTES = 16 * 1024


class _Skip:
    """Chunks dropped here, in their place in the stream: how many bytes, and their end."""

    def __init__(self) -> None:
        self.size = 0
        self.tail = bytearray()


_Item = Union[bytes, _Skip, Callable[[], object]]


class OutputQueue:
    """Feeds ``write(chunk)`` from a thread, never blocking ``put``; what does not fit in
    ``max_bytes`` is dropped (``dropped_bytes``) and reported in its place through
    ``skipped(size, tail, why)``. Neither callable may block ``put``: they run on the
    queue's own thread, and what they raise is dropped."""

    def __init__(self, write: Callable[[bytes], object], *, name: str,
                 skipped: Callable[[int, bytes, str], object] | None = None,
                 max_bytes: int = MAX_QUEUED_BYTES):
        self._write, self._skipped, self.max_bytes = write, skipped, max_bytes
        self.dropped_bytes = 0
        self._items: deque[_Item] = deque()
        self._queued = 0  # bytes waiting or being written
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def why(self) -> str:
        """Why chunks are dropped here, in words."""
        return f"its writer fell {self.max_bytes >> 20} MiB behind (a slow or hung disk)"

    def put(self, data: bytes) -> None:
        """Queue ``data``, or drop and count it when the backlog is full; never waits on I/O."""
        if not data:
            return
        with self._cond:
            if self._closed:
                return
            if self._queued + len(data) <= self.max_bytes:
                self._items.append(bytes(data))
                self._queued += len(data)
            else:
                self.dropped_bytes += len(data)
                skip = self._items[-1] if self._items else None
                if not isinstance(skip, _Skip):
                    for item in self._items:  # only the newest stretch keeps its end
                        if isinstance(item, _Skip):
                            item.tail = bytearray()
                    skip = _Skip()
                    self._items.append(skip)
                skip.size += len(data)
                skip.tail += data
                del skip.tail[:-SKIPPED_TAIL_BYTES]
            self._cond.notify()

    def call(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the queue's thread after everything queued so far."""
        with self._cond:
            if not self._closed:
                self._items.append(fn)
                self._cond.notify()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for everything queued so far to be handed on."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._busy, timeout)

    def close(self, timeout: float) -> bool:
        """Hand on what is queued (up to ``timeout``), then end the thread; later chunks
        are ignored. False: the writer is still busy (a hung disk), and keeps its thread."""
        flushed = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return flushed

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._items or self._closed)
                if not self._items:
                    return
                items = list(self._items)
                self._items.clear()
                self._busy = True
            for item in _joined(items):
                self._hand_on(item)
                if isinstance(item, bytes):
                    with self._cond:
                        self._queued -= len(item)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _hand_on(self, item: _Item) -> None:
        try:
            if isinstance(item, bytes):
                self._write(item)
            elif isinstance(item, _Skip):
                if self._skipped is not None:
                    self._skipped(item.size, bytes(item.tail), self.why)
            else:
                item()
        except Exception:  # the queue goes on whatever its writer does
            pass


def _joined(items: list[_Item]) -> list[_Item]:
    """Adjacent chunks as one (one write for a burst of lines), the rest in place."""
    out: list[_Item] = []
    run: list[bytes] = []
    for item in items:
        if isinstance(item, bytes):
            run.append(item)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(item)
    if run:
        out.append(b"".join(run))
    return out
