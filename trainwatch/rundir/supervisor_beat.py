"""The supervisor's heartbeat: evidence, for the node agent, that the run's supervisor is
alive and not frozen, which does not share its failure.

The embedded alert engine lives in the supervisor (``trainwatch run``), so a frozen
(SIGSTOP) or dead supervisor cannot page about itself. It writes ``RUN_DIR/supervisor.beat``
every ``BEAT_SECONDS`` from a thread of its own: one fixed-size record overwritten in
place (the rank beat's format, ``trainwatch/rundir/beat.py``), so it still gets through on
a full disk. The record names the lock holder's ``token`` (``rundir/runlock.py``): the
agent on the supervisor's host trusts a beat only of the holder the lock names, and judges
that process itself (``agent/collectors/supervisor.py``). A holder that writes no beat
(``trainwatch train`` by hand, ``rehearse``) is not watched: nothing there to repair.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from trainwatch.rundir.beat import BeatWriter, read_beat
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import Holder

log = logging.getLogger(__name__)

BEAT_SECONDS = 1.0


class SupervisorBeat:
    """Writes the supervisor's heartbeat every ``interval`` seconds until ``stop()``. A
    write that fails is logged once and retried: it never harms the supervision."""

    def __init__(self, run: RunDir, holder: Holder, interval: float = BEAT_SECONDS,
                 path: Path | None = None):
        self.run, self.holder, self.interval = run, holder, interval
        # A multi-node job's node supervisor beats beside its node's lock (supervisors/).
        self.path = run.supervisor_beat_file if path is None else path
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writer: BeatWriter | None = None
        self._failed = False

    def start(self) -> "SupervisorBeat":
        try:
            self._writer = BeatWriter(self.path)
        except OSError as exc:
            log.warning("cannot write the supervisor heartbeat %s: %s (the node agent will "
                        "not see this supervisor)", self.path, exc)
            return self
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="tw-supervisor-beat",
                                        daemon=True)
        self._thread.start()
        return self

    def record(self) -> dict[str, Any]:
        return {"pid": self.holder.pid, "host": self.holder.host, "token": self.holder.token,
                "role": self.holder.role, "at": time.time(), "interval": self.interval}

    def beat(self) -> None:
        if self._writer is None:
            return
        try:
            self._writer.write(self.record())
            self._failed = False
        except OSError as exc:
            if not self._failed:
                log.warning("cannot write the supervisor heartbeat: %s", exc)
            self._failed = True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_supervisor_beat(run: RunDir, node: str | None = None) -> dict[str, Any] | None:
    """The supervisor's newest heartbeat record (``node``: that node's of a multi-node
    job), or None (none, torn, alien)."""
    path = run.supervisor_beat_file if node is None else run.node_supervisor_beat_file(node)
    return read_beat(path, run.root)


def beat_age(record: dict[str, Any] | None, now: float | None = None) -> float | None:
    """Seconds since the record's beat (never negative), or None when it has no time."""
    at = record.get("at") if record else None
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        return None
    return max(0.0, (time.time() if now is None else now) - float(at))


__all__ = ["BEAT_SECONDS", "SupervisorBeat", "beat_age", "read_supervisor_beat"]
