"""The snapshots' writer thread: started once, handed one write at a time.

A thread started per snapshot took the GIL as it started (Python code runs to say it has
started) and the loop got it back only at the switch interval: 8 ms median at load 7, four
times the copy of the reference model's state. A thread kept waiting on a condition is
woken by ``submit`` without the loop waiting for it; the GIL the write then holds (building
its index, payload.py) is measured by the write and counted by cadence.py.
"""

from __future__ import annotations

import threading
from typing import Callable


class Writer:
    """``submit`` a write (the previous one done: ``wait`` first), ``wait``, ``close``."""

    def __init__(self, name: str):
        self.name = name
        self._cond = threading.Condition()
        self._job: Callable[[], None] | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the writer thread; RuntimeError when no thread can be started."""
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                thread.start()
                self._thread = thread
            self._job = job
            self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return self._job is not None

    def wait(self) -> None:
        """Until the write handed over last is done."""
        with self._cond:
            self._cond.wait_for(lambda: self._job is None or self._thread is None
                                or not self._thread.is_alive())

    def close(self) -> None:
        """Wait for the write in flight, then end the thread."""
        self.wait()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._job is not None)
                if self._job is None:
                    return
                job = self._job
            try:
                job()  # never raises: the snapshotter's write counts its own failures
            finally:
                with self._cond:
                    self._job = None
                    self._cond.notify_all()
