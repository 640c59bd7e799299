"""A rank's status fields become the same series whoever exports them: the agent's ranks
collector and the rank's own metrics server read one table (trainwatch/contract/metrics.py)."""

from __future__ import annotations

from trainwatch.agent.collectors.ranks import _rank_rows, _RankSeries
from trainwatch.rundir.beat import merge_beat
from trainwatch.contract.metrics import (COUNTER_FIELD_METRICS, EVAL_FIELD_METRICS, METRICS,
                                         PHASE_SECONDS_FIELD, PHASE_TIME_METRIC,
                                         STATUS_FIELD_METRICS, STEP_FIELD_METRICS)
from trainwatch.rank.metrics_server import TelemetryCollector

LABELS = {"run": "exp", "node": "n0", "rank": "0", "local_rank": "0"}


def _status() -> dict:
    """A status whose every tabled field has its own value (1, 2, ...)."""
    values = iter(range(1, 100))
    return {"job": "exp", "node": "n0", "rank": 0, "local_rank": 0,
            **{field: next(values) for field in STATUS_FIELD_METRICS},
            "eval": {field: float(next(values)) for field in EVAL_FIELD_METRICS},
            "metrics": {**{field: float(next(values)) for field in STEP_FIELD_METRICS},
                        PHASE_SECONDS_FIELD: {"forward": float(next(values))}},
            "counters": {field: next(values) for field in COUNTER_FIELD_METRICS}}


def _expected(status: dict) -> dict[str, float]:
    return {**{name: status[field] for field, name in STATUS_FIELD_METRICS.items()},
            **{name: status["eval"][field] for field, name in EVAL_FIELD_METRICS.items()},
            **{name: status["metrics"][field] for field, name in STEP_FIELD_METRICS.items()},
            **{name: status["counters"][field] for field, name in COUNTER_FIELD_METRICS.items()},
            PHASE_TIME_METRIC: status["metrics"][PHASE_SECONDS_FIELD]["forward"]}


def test_the_tables_name_contract_metrics_of_the_right_type():
    gauges = [*STEP_FIELD_METRICS.values(), *STATUS_FIELD_METRICS.values(),
              *EVAL_FIELD_METRICS.values(), PHASE_TIME_METRIC]
    assert all(METRICS[name].type == "gauge" for name in gauges)
    assert all(METRICS[name].type == "counter" for name in COUNTER_FIELD_METRICS.values())


def test_agent_and_rank_server_export_each_status_field_under_one_name():
    status = _status()
    expected = _expected(status)
    ages = {"heartbeat": 0.0, "progress": 0.0, "phase": 0.0}
    agent = {s.name: s.value for s in _rank_rows(_RankSeries(LABELS), status, status,
                                                 "running", None, ages, None,
                                                 {"status": "running"})}

    class Stub:
        def snapshot(self) -> dict:
            return status

    server = {s.name: s.value
              for family in TelemetryCollector(Stub()).collect()  # type: ignore[arg-type]
              for s in family.samples}
    assert {name: v for name, v in agent.items() if name in expected} == expected
    assert {name: v for name, v in server.items() if name in expected} == expected


def test_the_agent_keeps_a_status_s_rows_while_it_stands_and_follows_the_beat():
    """Rows of the status as parsed are made once per parse (a rank is exported every
    second, its status parsed every few); what a beat brings newer is followed each time."""
    status, series = _status(), _RankSeries(LABELS)
    ages = {"heartbeat": 0.0, "progress": 0.0, "phase": 0.0}

    def rows(raw: dict, merged: dict) -> dict[str, float]:
        return {s.name: s.value for s in _rank_rows(series, raw, merged, "running", None,
                                                    ages, None, {"status": "running"})}

    first = rows(status, status)
    beat = merge_beat(status, {"rank": 0, "pid": None, "heartbeat_at": 5.0, "step": 77,
                               "steps_total": 78, "step_time_seconds": 0.5})[0]
    later = rows(status, beat)
    assert later["trainwatch_rank_step"] == 77 and later["trainwatch_rank_steps_total"] == 78
    assert later["trainwatch_rank_step_time_seconds"] == 0.5
    assert {k: v for k, v in later.items() if k not in (
        "trainwatch_rank_step", "trainwatch_rank_steps_total",
        "trainwatch_rank_step_time_seconds")} == {k: v for k, v in first.items() if k not in (
        "trainwatch_rank_step", "trainwatch_rank_steps_total",
        "trainwatch_rank_step_time_seconds")}
    parsed = dict(status, metrics=dict(status["metrics"], loss=-1.0))  # read again
    assert rows(parsed, parsed)["trainwatch_train_loss"] == -1.0
