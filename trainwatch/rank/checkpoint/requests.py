"""Save and stop requests that arrive between step boundaries.

SIGUSR1 or touching ``RUN_DIR/control/checkpoint`` asks for a save; SIGTERM asks for a
save and a clean exit (a second SIGTERM to this rank kills at once, as if unhandled, unless it comes
within ``REPEAT_SECONDS`` of the first: a killed ``trainwatch run`` delivers SIGTERM to
torchrun once per thread it had, PR_SET_PDEATHSIG, and torchrun passes each one on within
milliseconds; that repeat is the same stop, and killing on it lost every step since the last
checkpoint).  Handlers only set flags; the loop acts on them at the next step boundary,
after every rank agreed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from trainwatch.contract.layout import CONTROL_CHECKPOINT

log = logging.getLogger(__name__)

# A SIGTERM this soon after the first is the same stop delivered again, not a second ask.
REPEAT_SECONDS = 2.0


def repeated_term(first_at: float | None) -> bool:
    """Whether a SIGTERM arriving now is the first one (received at monotonic ``first_at``)
    delivered again: every loop trainwatch stops ignores those instead of dying unsaved."""
    return first_at is not None and time.monotonic() - first_at < REPEAT_SECONDS


class Requests:
    """Flags set by signals and the control file, read (and cleared) at a step boundary."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.save = False
        self.stop = False
        self.sources: list[str] = []
        self._previous: dict[int, Any] = {}
        self._first_term: float | None = None  # monotonic time of the first SIGTERM
        self._term_checked = False  # whether our SIGTERM handler was looked for yet

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
        if not self._term_checked:
            self._check_term_handler()
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

    def _check_term_handler(self) -> None:
        """Say once, at the first step, when the script replaced our SIGTERM handler after
        installing it: a stop would then neither save nor exit 75."""
        self._term_checked = True
        if signal.SIGTERM not in self._previous:
            return
        current = signal.getsignal(signal.SIGTERM)
        if current != self._on_term:
            name = getattr(current, "__qualname__", None) or repr(current)
            log.warning("trainwatch checkpoint: SIGTERM's handler is now %s, installed after "
                        "Checkpoints' own: a SIGTERM (a stop, a preemption) will not save a "
                        "checkpoint or exit 75; leave SIGTERM to trainwatch (maybe_save saves "
                        "and exits), or save and exit in yours", name)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _on_usr1(self, signum: int, frame: Any) -> None:
        self.ask_save("SIGUSR1")

    def _on_term(self, signum: int, frame: Any) -> None:
        if repeated_term(self._first_term):
            return  # the same stop, delivered again (a launcher forwarding each SIGTERM)
        if self._first_term is not None:  # asked twice: the loop is not reaching a
            # boundary, die as asked. A stop agreed from another rank's ask (``stop`` set by
            # the agreement) is no ask of this rank's: its own first SIGTERM, its launcher's
            # on a node stopped a moment later, lands while it saves and must not kill it.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._first_term = time.monotonic()
        self.ask_stop("SIGTERM")
