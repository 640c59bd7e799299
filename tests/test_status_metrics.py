"""A rank's status fields become the same series whoever exports them: the agent's ranks
collector and the rank's own metrics server read one table (trainwatch/contract/metrics.py)."""

from __future__ import annotations

from trainwatch.agent.collectors.ranks import _Labels, _rank_samples
from trainwatch.contract.metrics import COUNTER_FIELD_METRICS, METRICS, STEP_FIELD_METRICS
from trainwatch.trainer.metrics_server import TelemetryCollector


def _status() -> dict:
    """A status whose every tabled field has its own value (1, 2, ...)."""
    values = iter(range(1, 100))
    return {"job": "exp", "node": "n0", "rank": 0, "local_rank": 0,
            "metrics": {field: float(next(values)) for field in STEP_FIELD_METRICS},
            "counters": {field: next(values) for field in COUNTER_FIELD_METRICS}}


def _tabled(series: dict[str, float]) -> dict[str, float]:
    names = set(STEP_FIELD_METRICS.values()) | set(COUNTER_FIELD_METRICS.values())
    return {name: value for name, value in series.items() if name in names}


def test_the_tables_name_contract_metrics_of_the_right_type():
    assert all(METRICS[name].type == "gauge" for name in STEP_FIELD_METRICS.values())
    assert all(METRICS[name].type == "counter" for name in COUNTER_FIELD_METRICS.values())


def test_agent_and_rank_server_export_each_status_field_under_one_name():
    status = _status()
    labels = {"run": "exp", "node": "n0", "rank": "0", "local_rank": "0"}
    agent = {s.name: s.value for s in _rank_samples(_Labels(labels), status, "running", None,
                                                    {"heartbeat": 0.0, "progress": 0.0,
                                                     "phase": 0.0}, None,
                                                    {"status": "running"})}

    class Stub:
        def snapshot(self) -> dict:
            return status

    server = {s.name: s.value for family in TelemetryCollector(Stub()).collect()  # type: ignore[arg-type]
              for s in family.samples}
    expected = {**{name: status["metrics"][field] for field, name in STEP_FIELD_METRICS.items()},
                **{name: status["counters"][field]
                   for field, name in COUNTER_FIELD_METRICS.items()}}
    assert _tabled(agent) == expected
    assert _tabled(server) == expected
