"""Prometheus exposition of the last collected values (a prometheus-client custom collector).

Nothing here touches hardware: a scrape only formats what the collectors stored.
Only names declared in ``trainwatch/contract/metrics.py`` are exported, with exactly
their declared labels; anything else is dropped, counted and logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import psutil
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from trainwatch.agent.context import AgentContext
from trainwatch.agent.registry import Sample
from trainwatch.contract.states import COLLECTOR_STATES
from trainwatch.contract.metrics import METRICS

log = logging.getLogger(__name__)


class SnapshotCollector:
    """Turns the state store into metric families at scrape time."""

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.rejected: set[str] = set()
        self._self = psutil.Process()

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families depend on what was collected

    def collect(self) -> Iterator[Metric]:
        by_name: dict[str, list[Sample]] = defaultdict(list)
        for sample in self._samples():
            by_name[sample.name].append(sample)
        for name in sorted(by_name):
            family = self._family(name, by_name[name])
            if family is not None:
                yield family

    def _samples(self) -> Iterable[Sample]:
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

    def _family(self, name: str, samples: list[Sample]) -> Metric | None:
        spec = METRICS.get(name)
        if spec is None:
            self._reject(name, "not in the metrics contract")
            return None
        labels = list(spec.labels)
        if spec.type == "counter":
            family: Metric = CounterMetricFamily(name, spec.help, labels=labels)
        else:
            family = GaugeMetricFamily(name, spec.help, labels=labels)
        seen: set[tuple[str, ...]] = set()
        wanted = set(labels)
        for sample in samples:
            if sample.labels.keys() != wanted:
                self._reject(name, f"labels {sorted(sample.labels)} != {labels}")
                continue
            values = tuple(sample.labels[k] for k in labels)
            if values in seen:  # two run dirs claiming the same rank: keep the first
                continue
            seen.add(values)
            family.add_metric(list(values), sample.value)
        return family

    def _reject(self, name: str, why: str) -> None:
        if name not in self.rejected:
            self.rejected.add(name)
            log.error("not exporting %s: %s", name, why)


class CachedExposition:
    """The rendered /metrics body per exposition format, so frequent scrapes do not each
    pay for a rendering.

    The format follows the scrape's Accept header (prometheus-client's ``choose_encoder``):
    OpenMetrics when asked, the classic text format otherwise. A body younger than
    ``max_age`` is served as is; if collectors stored something newer meanwhile, it is
    re-rendered in the background for the next scrape (stale-while-revalidate, at most
    ``max_age`` old). An older body is re-rendered before answering, so a scrape every
    15 s always gets fresh values and an idle agent renders nothing.
    """

    def __init__(self, ctx: AgentContext, registry: CollectorRegistry, max_age: float = 1.0):
        self.ctx, self.registry, self.max_age = ctx, registry, max_age
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        self._cache: dict[str, _Rendered] = {}

    def _render(self, content_type: str, encoder: Callable[[CollectorRegistry], bytes]) -> None:
        with self._render_lock:
            version = self.ctx.store.version
            body = encoder(self.registry)
            with self._lock:
                self._cache[content_type] = _Rendered(body, version, time.monotonic())

    def body(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) for a scrape sending this Accept header."""
        encoder, content_type = choose_encoder(accept)
        with self._lock:
            cached = self._cache.get(content_type)
            if cached is not None and time.monotonic() - cached.at < self.max_age:
                if self.ctx.store.version != cached.version and not cached.refreshing:
                    cached.refreshing = True
                    threading.Thread(target=self._render, args=(content_type, encoder),
                                     daemon=True, name="metrics-render").start()
                return cached.body, content_type
        self._render(content_type, encoder)
        with self._lock:
            return self._cache[content_type].body, content_type


@dataclass
class _Rendered:
    body: bytes
    version: int
    at: float
    refreshing: bool = False


def build_registry(ctx: AgentContext) -> tuple[CollectorRegistry, SnapshotCollector]:
    """A registry holding only trainwatch's families (no default process/python metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = SnapshotCollector(ctx)
    registry.register(collector)
    return registry, collector


