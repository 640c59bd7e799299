"""Prometheus metrics served by a rank itself, for users who run no trainwatch agent.

``telemetry.metrics_port: P`` makes local rank r serve http://127.0.0.1:(P+r)/metrics.
Values come from the rank's telemetry state (what its status file shows), so a
scrape never touches the training loop or the device. Names, types and help text
are those of trainwatch/contract/metrics.py; the agent exports the same series
from the status files, so use one or the other for a given run.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trainwatch.contract.metrics import (COUNTER_FIELD_METRICS, EVAL_FIELD_METRICS, METRICS,
                                          PHASE_SECONDS_FIELD, PHASE_TIME_METRIC, RUN_RANK,
                                          STATUS_FIELD_METRICS, STEP_FIELD_METRICS)
from trainwatch.contract.ports import LOOPBACK
from trainwatch.rank.telemetry import Telemetry

log = logging.getLogger(__name__)


def _family(name: str,
            extra_labels: tuple[str, ...] = ()) -> CounterMetricFamily | GaugeMetricFamily:
    spec = METRICS[name]
    assert spec.labels == RUN_RANK + extra_labels, name
    cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
    return cls(name, spec.help, labels=spec.labels)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class TelemetryCollector:
    """A prometheus-client collector reading one rank's telemetry state at scrape time."""

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry

    def collect(self) -> Iterator[Metric]:
        state = self.telemetry.snapshot()
        labels = [state["job"], state["node"], str(state["rank"]), str(state["local_rank"])]
        step_record = state.get("metrics") or {}
        for key, name in STEP_FIELD_METRICS.items():
            value = _number(step_record.get(key))
            if value is not None:  # absent, not invented (e.g. MFU with no known peak)
                family = _family(name)
                family.add_metric(labels, value)
                yield family
        phases = _family(PHASE_TIME_METRIC, ("phase",))
        for phase, seconds in (step_record.get(PHASE_SECONDS_FIELD) or {}).items():
            phases.add_metric([*labels, phase], float(seconds))
        yield phases
        evals = state.get("eval") or {}
        for name, value in [*((n, state.get(f)) for f, n in STATUS_FIELD_METRICS.items()),
                            *((n, evals.get(f)) for f, n in EVAL_FIELD_METRICS.items())]:
            number = _number(value)
            if number is not None:
                family = _family(name)
                family.add_metric(labels, number)
                yield family
        for key, name in COUNTER_FIELD_METRICS.items():
            family = _family(name)
            family.add_metric(labels, float(state["counters"].get(key, 0)))
            yield family


class MetricsServer:
    """The HTTP endpoint; failing to bind is logged and counted, never raised."""

    def __init__(self, telemetry: Telemetry, port: int, addr: str = LOOPBACK):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TelemetryCollector(telemetry))
        self.server = None
        try:
            self.server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            telemetry.count_error(f"metrics port {addr}:{port}: {exc.strerror}")

    @property
    def port(self) -> int | None:
        return self.server.server_port if self.server is not None else None

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
