"""Save and stop requests that arrive between step boundaries.

SIGUSR1 or touching ``RUN_DIR/control/checkpoint`` asks for a save; SIGTERM asks for a
save and a clean exit (a second SIGTERM kills at once, as if unhandled).  Handlers only set
flags; the loop acts on them at the next step boundary, after every rank agreed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from trainwatch.contract.layout import CONTROL_CHECKPOINT

log = logging.getLogger(__name__)


class Requests:
    """Flags set by signals and the control file, read (and cleared) at a step boundary."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.save = False
        self.stop = False
        self.sources: list[str] = []
        self._previous: dict[int, Any] = {}

    def ask_save(self, source: str) -> None:
        with self._lock:
            self.save = True
            self.sources.append(source)

    def ask_stop(self, source: str) -> None:
        with self._lock:
            self.stop = True
            self.sources.append(source)

    def take(self) -> tuple[bool, bool, list[str]]:
        """This rank's requests since the last call (stop stays set: it is final)."""
        with self._lock:
            taken = (self.save, self.stop, self.sources)
            self.save, self.sources = False, []
        return taken

    def install(self, telemetry: Any = None) -> None:
        """Signal handlers (main thread only) and the control-file handler."""
        if telemetry is not None:
            telemetry.on_control(CONTROL_CHECKPOINT, lambda path: self.ask_save(f"control file {path}"))
        if threading.current_thread() is not threading.main_thread():
            log.warning("trainwatch checkpoint: not in the main thread, SIGUSR1/SIGTERM not handled")
            return
        self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_term)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _on_usr1(self, signum: int, frame: Any) -> None:
        self.ask_save("SIGUSR1")

    def _on_term(self, signum: int, frame: Any) -> None:
        if self.stop:  # asked twice: the loop is not reaching a boundary, die as asked
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.ask_stop("SIGTERM")
