"""/metrics: the last collected values, rendered at scrape time (``agent/exposition.py``).

Nothing here touches hardware: a scrape only formats what the collectors stored, plus
the collectors' own health and the agent's CPU and memory.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import psutil

from trainwatch.agent.context import AgentContext
from trainwatch.agent.exposition import ExpositionWriter, content_type_for
from trainwatch.agent.registry import Sample
from trainwatch.contract.metrics import METRICS
from trainwatch.contract.states import COLLECTOR_STATES

log = logging.getLogger(__name__)


class SnapshotExporter:
    """The state store as an exposition body; names outside the contract are dropped and
    logged once (``rejected`` lists them)."""

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.rejected: set[str] = set()
        self._self = psutil.Process()
        self.writer = ExpositionWriter(METRICS, self._reject)

    def render(self, content_type: str) -> bytes:
        return self.writer.render(self.samples(), content_type)

    def samples(self) -> Iterable[Sample]:
        node = self.ctx.node
        records = self.ctx.store.snapshot()
        for record in records.values():
            yield from record.samples
        for name, record in sorted(records.items()):
            labels = {"node": node, "collector": name}
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
        times = self._self.cpu_times()
        yield Sample("trainwatch_collector_agent_cpu_seconds_total", {"node": node},
                     times.user + times.system)
        yield Sample("trainwatch_collector_agent_resident_memory_bytes", {"node": node},
                     self._self.memory_info().rss)

    def _reject(self, name: str, why: str) -> None:
        if name not in self.rejected:
            self.rejected.add(name)
            log.error("not exporting %s: %s", name, why)


class CachedExposition:
    """The rendered /metrics body per exposition format, so frequent scrapes do not each
    pay for a rendering.

    The format follows the scrape's Accept header: OpenMetrics when asked, the text
    format otherwise. A body younger than ``max_age`` is served as is; if collectors
    stored something newer meanwhile, it is re-rendered in the background for the next
    scrape (stale-while-revalidate, at most ``max_age`` old). An older body is re-rendered
    before answering, so a scrape every 15 s always gets fresh values and an idle agent
    renders nothing.
    """

    def __init__(self, ctx: AgentContext, exporter: SnapshotExporter, max_age: float = 1.0):
        self.ctx, self.exporter, self.max_age = ctx, exporter, max_age
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        self._cache: dict[str, _Rendered] = {}

    def _render(self, content_type: str) -> None:
        with self._render_lock:
            version = self.ctx.store.version
            body = self.exporter.render(content_type)
            with self._lock:
                self._cache[content_type] = _Rendered(body, version, time.monotonic())

    def body(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) for a scrape sending this Accept header."""
        content_type = content_type_for(accept)
        with self._lock:
            cached = self._cache.get(content_type)
            if cached is not None and time.monotonic() - cached.at < self.max_age:
                if self.ctx.store.version != cached.version and not cached.refreshing:
                    cached.refreshing = True
                    threading.Thread(target=self._render, args=(content_type,),
                                     daemon=True, name="metrics-render").start()
                return cached.body, content_type
        self._render(content_type)
        with self._lock:
            return self._cache[content_type].body, content_type


@dataclass
class _Rendered:
    body: bytes
    version: int
    at: float
    refreshing: bool = False
