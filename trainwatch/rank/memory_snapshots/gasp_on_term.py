"""The dying gasp at SIGTERM while the loop's thread is blocked in C.

torchrun answers a failed rank by SIGTERMing the others and SIGKILLing them 30 s later. A
survivor whose main thread is blocked in C (a collective that never returns: NCCL after a
peer died, a peer whose connection a forked child still holds open, a network partition)
never returns to the interpreter: its Python SIGTERM handler does not run, no teardown
comes, and no gasp is written before the SIGKILL. Python's C-level handler still writes the
signal's number to ``signal.set_wakeup_fd``'s fd whatever the main thread does, so a thread
of ours reads that fd. At a SIGTERM it watches the main thread for ``MAIN_THREAD_S``: when
its Python frame moved (it runs Python: it stops at its next boundary with a checkpoint, or
gasps in its teardown), nothing more; when it did not, it writes the gasp from the state as
it is, which dying_gasp.py's guards (version counters, the optimizer pre-step lock) accept
only while it is still the last completed step's. The gasp is bounded as every gasp is and
runs on a daemon thread: the process's exit is never delayed by it.

A forked child (a data loader's worker) inherits the wakeup fd and would write its own
signals into our pipe: the child gives it up at once (``os.register_at_fork``). A wakeup fd
the script (or asyncio) set is never replaced: then there is no SIGTERM-time
gasp, and a warning says so. Only the main thread can set it, so only a loop on the main
thread gets it.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

MAIN_THREAD_S = 1.0   # how long the main thread may stay on one bytecode before we gasp
POLL_S = 0.02


class GaspOnTerm:
    """Reads the wakeup fd on its own thread; ``gasp(reason)`` when a SIGTERM finds the main
    thread stuck. ``start`` and ``close`` on the main thread."""

    def __init__(self, gasp: Callable[[str], Any]):
        self._gasp = gasp
        self._read = self._write = -1
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()  # close() began: the main thread is ours, not stuck
        self.off_reason: str | None = None

    def start(self) -> bool:
        """Set our wakeup fd and start the reader; False (``off_reason``) where it cannot."""
        if threading.current_thread() is not threading.main_thread():
            self.off_reason = "the loop is not on the main thread (no wakeup fd to set)"
            return False
        read, write = os.pipe()
        for fd in (read, write):
            os.set_blocking(fd, False)
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError) as exc:
            os.close(read)
            os.close(write)
            self.off_reason = f"cannot set a wakeup fd: {exc}"
            return False
        if previous != -1:  # the script's own (asyncio, a signal loop): put back, not stolen
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            self.off_reason = (f"the script set its own signal wakeup fd ({previous}): no "
                               "dying gasp at a SIGTERM that finds the loop blocked in C")
            log.warning("trainwatch memory snapshots: %s", self.off_reason)
            return False
        self._read, self._write = read, write
        os.register_at_fork(after_in_child=self._in_child)
        self._thread = threading.Thread(target=self._listen, daemon=True,
                                        name="trainwatch-gasp-on-sigterm")
        self._thread.start()
        return True

    def _listen(self) -> None:
        while True:
            try:
                select.select([self._read], [], [])
                got = os.read(self._read, 512)
            except BlockingIOError:
                continue
            except OSError:
                return  # closed
            if not got:
                return
            if signal.SIGTERM in got and self._main_thread_stuck():
                self._gasp(f"SIGTERM while the main thread was blocked in C for "
                           f"{MAIN_THREAD_S:.0f} s (its Python handler could not run)")

    def _main_thread_stuck(self) -> bool:
        """Whether the main thread stays on one bytecode of one frame for MAIN_THREAD_S.
        Not while ``close`` runs: the main thread then waits in our join, which looks stuck,
        and the teardown closing us gasps itself (a watch begun by the stop's SIGTERM had
        held every failed rank's exit up by a second, and gasped a second time)."""
        main = threading.main_thread().ident

        def where() -> tuple[int, int] | None:
            frame = sys._current_frames().get(main or -1)
            return None if frame is None else (id(frame), frame.f_lasti)

        first = where()
        deadline = time.monotonic() + MAIN_THREAD_S
        while time.monotonic() < deadline:
            if self._closing.wait(POLL_S) or where() != first:
                return False
        return first is not None and not self._closing.is_set()

    def _in_child(self) -> None:
        """A forked child: its signals are not this rank's (no reader runs there)."""
        if self._write == -1:
            return
        try:
            current = signal.set_wakeup_fd(-1)
        except ValueError:  # forked from a thread other than the main one: it stays set,
            return          # so its pipe stays open (never a reused fd number written to)
        if current not in (-1, self._write):  # not ours any more: theirs stays
            signal.set_wakeup_fd(current)
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1

    def close(self) -> None:
        """Give the wakeup fd back (main thread only: elsewhere it stays set, and its pipe
        open, so the C handler never writes into an fd number reused for another file)."""
        if self._write == -1 or threading.current_thread() is not threading.main_thread():
            return
        self._closing.set()
        current = signal.set_wakeup_fd(-1)
        if current not in (-1, self._write):  # set after ours by someone else: theirs stays
            signal.set_wakeup_fd(current)
        os.close(self._write)  # the reader sees the end (its select returns, read gives b"")
        self._write = -1
        if self._thread is not None:
            self._thread.join(1.0)
        os.close(self._read)
        self._read = -1
