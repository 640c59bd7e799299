"""SIGTERM for a framework callback: a flag the training loop reads at a step's end.

The handler only sets the flag (no collective, no I/O: Lightning's own handler broadcasts
inside the handler, and a second SIGTERM landing in the middle of a save desynchronised the
ranks' collectives). A SIGTERM within ``REPEAT_SECONDS`` of the first is the same stop
delivered again (Slurm signals every process of a step and torchrun forwards its copy; a
killed ``trainwatch run`` sends one per thread): ignored. A later one means the loop is not
reaching a step's end: the process dies as if unhandled.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

from trainwatch.rank.checkpoint.requests import repeated_term


class StopSignal:
    """Takes SIGTERM (main thread only) until ``restore``; ``asked`` is set by the first."""

    def __init__(self, on_first: Callable[[int], Any] | None = None) -> None:
        self.asked = threading.Event()
        self._on_first = on_first  # also told of the first SIGTERM (in the handler)
        self._first_at: float | None = None  # monotonic time of the first SIGTERM
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and not self._installed:
            self._previous = signal.signal(signal.SIGTERM, self.on_term)
            self._installed = True

    def restore(self) -> None:
        """Put back the handler from before ``install``, unless another replaced ours since
        (Lightning's teardown puts back the handlers from before fit: ours would then undo it)."""
        if self._installed:
            if signal.getsignal(signal.SIGTERM) == self.on_term:
                signal.signal(signal.SIGTERM, self._previous)
            self._installed, self._previous = False, None

    def on_term(self, signum: int, frame: Any) -> None:
        if repeated_term(self._first_at):
            return  # the same stop, delivered again
        if self.asked.is_set():  # asked twice: not reaching a step's end, die as asked
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._first_at = time.monotonic()
        self.asked.set()
        if self._on_first is not None:
            self._on_first(signum)
