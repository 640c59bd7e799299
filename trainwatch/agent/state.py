"""The agent's last collected values: what /metrics and /status are served from.

Collectors write here when a run finishes; readers take a reference to the
current record (records are replaced, never mutated in place), so a scrape
never waits on a collector and never sees half a run.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from trainwatch.agent.registry import Result, Sample


@dataclass(frozen=True)
class CollectorRecord:
    name: str
    enabled: bool
    interval: float
    timeout: float
    state: str = "pending"
    reason: str | None = None
    samples: Iterable[Sample] = ()  # a tuple, or Deferred samples built when read
    data: Any = None
    last_run_at: float | None = None
    last_success_at: float | None = None
    duration: float | None = None
    runs: int = 0
    errors: int = 0
    timeouts: int = 0

    def summary(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "state": self.state, "reason": self.reason,
                "interval_seconds": self.interval, "timeout_seconds": self.timeout,
                "last_run_at": self.last_run_at, "last_success_at": self.last_success_at,
                "duration_seconds": self.duration, "runs_total": self.runs,
                "errors_total": self.errors, "timeouts_total": self.timeouts}


@dataclass
class StateStore:
    records: dict[str, CollectorRecord] = field(default_factory=dict)
    version: int = 0  # bumped on every change: lets /metrics reuse its last rendering
    changed: threading.Event = field(default_factory=threading.Event)  # set on every bump
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, record: CollectorRecord) -> None:
        with self._lock:
            self.records[record.name] = record
            self.version += 1
        self.changed.set()

    def get(self, name: str) -> CollectorRecord | None:
        return self.records.get(name)

    def data(self, name: str) -> Any:
        """The named collector's last summary, or None if it has none (absent, failed)."""
        record = self.records.get(name)
        return record.data if record is not None else None

    def snapshot(self) -> dict[str, CollectorRecord]:
        with self._lock:
            return dict(self.records)

    def update(self, name: str, *, bump: bool = True, **changes: Any) -> CollectorRecord:
        """Replace fields of a record; ``bump=False`` for bookkeeping not worth a re-render."""
        with self._lock:
            record = replace(self.records[name], **changes)
            self.records[name] = record
            if bump:
                self.version += 1
                self.changed.set()
            return record

    def finish(self, name: str, result: Result, *, started: float, duration: float) -> None:
        """Store a completed run: samples only when ok (absent exports none)."""
        ok = result.state == "ok"
        samples = result.deferred() if ok else ()
        success: dict[str, Any] = {"last_success_at": started + duration} if ok else {}
        self.update(name, state=result.state, reason=result.reason,
                    samples=samples, data=result.data,
                    last_run_at=started, duration=duration, **success)
