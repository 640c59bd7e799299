"""/metrics: the last collected values, rendered at scrape time (``agent/exposition.py``).

Nothing here touches hardware: a scrape only formats what the collectors stored, plus
the collectors' own health and the agent's CPU and memory.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import psutil

from trainwatch.agent.context import AgentContext
from trainwatch.agent.exposition import ExpositionWriter, Families, content_type_for
from trainwatch.agent.registry import Sample
from trainwatch.agent.state import CollectorRecord
from trainwatch.contract.metrics import METRICS
from trainwatch.contract.states import COLLECTOR_STATES

log = logging.getLogger(__name__)

OWN_FIGURES_AGE = 5.0  # seconds a body may be served unchanged: the agent's own CPU and RSS


class SnapshotExporter:
    """The state store as an exposition body; names outside the contract are dropped and
    logged once (``rejected`` lists them).

    Each collector run's samples are rendered once, the first time a scrape reads them,
    and kept with the run's record (records are replaced, never changed): a scrape
    renders only the runs that finished since the last one and joins the rest as text.
    """

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.rejected: set[str] = set()
        self._self = psutil.Process()
        self.writer = ExpositionWriter(METRICS, self._reject)
        self._lock = threading.Lock()  # scrapes render in a pool of threads
        self._rendered: dict[str, tuple[CollectorRecord, Families, Families]] = {}

    def render(self, content_type: str) -> bytes:
        with self._lock:
            records = self.ctx.store.snapshot()
            for gone in self._rendered.keys() - records.keys():
                del self._rendered[gone]
                self.writer.forget(gone)
                self.writer.forget(("self", gone))
            parts = {name: self._families(name, record) for name, record in records.items()}
            agent = self.writer.families(self._agent_samples(), "agent")
            return self.writer.join([*(samples for samples, _ in parts.values()),
                                     *(parts[name][1] for name in sorted(parts)), agent],
                                    content_type)

    def _families(self, name: str, record: CollectorRecord) -> tuple[Families, Families]:
        """The record's samples and its collector's health, rendered (once per record)."""
        cached = self._rendered.get(name)
        if cached is not None and cached[0] is record:
            return cached[1], cached[2]
        if cached is not None and cached[0].samples is record.samples:
            samples = cached[1]  # the same run, only bookkeeping changed
        else:
            samples = self.writer.families(record.samples, name)
        own = self.writer.families(self._health(name, record), ("self", name))
        self._rendered[name] = (record, samples, own)
        return samples, own

    def _health(self, name: str, record: CollectorRecord) -> Iterator[Sample]:
        labels = {"node": self.ctx.node, "collector": name}
        yield Sample("trainwatch_collector_up", labels, 1.0 if record.state == "ok" else 0.0)
        for state in COLLECTOR_STATES:
            yield Sample("trainwatch_collector_state", {**labels, "state": state},
                         1.0 if record.state == state else 0.0)
        if record.duration is not None:
            yield Sample("trainwatch_collector_duration_seconds", labels, record.duration)
        if record.last_success_at is not None:
            yield Sample("trainwatch_collector_last_success_timestamp_seconds", labels,
                         record.last_success_at)
        yield Sample("trainwatch_collector_runs_total", labels, record.runs)
        yield Sample("trainwatch_collector_errors_total", labels, record.errors)
        yield Sample("trainwatch_collector_timeouts_total", labels, record.timeouts)

    def _agent_samples(self) -> Iterator[Sample]:
        node = self.ctx.node
        times = os.times()  # what psutil's cpu_times reads, from a system call, not /proc
        yield Sample("trainwatch_collector_agent_cpu_seconds_total", {"node": node},
                     times.user + times.system)
        yield Sample("trainwatch_collector_agent_resident_memory_bytes", {"node": node},
                     self._self.memory_info().rss)

    def _reject(self, name: str, why: str) -> None:
        if name not in self.rejected:
            self.rejected.add(name)
            log.error("not exporting %s: %s", name, why)


class CachedExposition:
    """The rendered /metrics body per exposition format, so a scrape serves bytes.

    The format follows the scrape's Accept header: OpenMetrics when asked, the text
    format otherwise. While a format is scraped often (its last two scrapes, and the
    last one, within ``eager_for`` seconds), a background thread renders it each time a
    collector stores something new, so a scrape at 1 s finds its body ready and each run
    is rendered once, off the scrape's path. A format scraped rarely (every 15 s) is
    rendered on the scrape instead: a collector running every second is then not
    rendered 14 times of 15 for nothing, and an idle agent renders nothing. A body is
    served while it is younger than ``max_age`` (a newer one is on its way) or matches
    the store (up to ``OWN_FIGURES_AGE``); otherwise it is rendered before answering.
    """

    def __init__(self, ctx: AgentContext, exporter: SnapshotExporter, max_age: float = 1.0,
                 eager_for: float = 3.0, settle: float = 0.05):
        self.ctx, self.exporter = ctx, exporter
        self.max_age, self.eager_for, self.settle = max_age, eager_for, settle
        self._lock = threading.Lock()
        self._cache: dict[str, _Rendered] = {}
        self._asked: dict[str, tuple[float, float]] = {}  # format -> its last two scrapes
        self._eager: threading.Thread | None = None

    def _render(self, content_type: str) -> _Rendered:
        version = self.ctx.store.version  # before: a change while rendering renders again
        rendered = _Rendered(self.exporter.render(content_type), version, time.monotonic())
        with self._lock:
            self._cache[content_type] = rendered
        return rendered

    def body(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) for a scrape sending this Accept header."""
        content_type = content_type_for(accept)
        now = time.monotonic()
        with self._lock:
            self._asked[content_type] = (self._asked.get(content_type, (-math.inf,))[-1], now)
            if self._eager is None:
                self._eager = threading.Thread(target=self._render_changes, daemon=True,
                                               name="metrics-render")
                self._eager.start()
            cached = self._cache.get(content_type)
        if cached is not None and (now - cached.at < self.max_age or (
                cached.version == self.ctx.store.version and now - cached.at < OWN_FIGURES_AGE)):
            return cached.body, content_type
        return self._render(content_type).body, content_type

    def _render_changes(self) -> None:
        """Renders every format scraped lately as soon as the store changes, once for the
        runs that finish within ``settle`` of each other: collectors of the same period
        finish together (ranks with findings and replicas right after it, the 5 s ones),
        and a render each had been nearly four a second for one scrape."""
        changed = self.ctx.store.changed
        while True:
            changed.wait()
            time.sleep(self.settle)
            changed.clear()
            now = time.monotonic()
            with self._lock:
                formats = [f for f, (before, last) in self._asked.items()
                           if now - before < self.eager_for]
            for content_type in formats:
                try:
                    self._render(content_type)
                except Exception:  # a scrape renders it again and reports what failed
                    log.exception("rendering /metrics in the background failed")


@dataclass
class _Rendered:
    body: bytes
    version: int
    at: float
