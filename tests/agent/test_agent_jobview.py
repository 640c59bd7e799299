"""The job-wide view from the run's own record (issue #34, item 4): "ranks up" of a job
whose node is lost reads 0 of 4, not 0 of 2, and the agents that remain name the node.

A shared run directory as on cluster storage, 2 nodes x 2 ranks: each agent counts only
its own node's ranks as up (tests/agent/test_agent_rank_locality.py), but every agent
exports what the run expects (run.json's world size) and which nodes still report.
"""

from __future__ import annotations

import os
import time

import pytest

from agent_helpers import collector, publish, samples, value, write_status
from trainwatch.agent.config import load_config
from trainwatch.agent.context import AgentContext
from trainwatch.contract.env import NODE_ENV
from trainwatch.rundir.run_dir import RunDir


def _agent(run: RunDir, node: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(NODE_ENV, node)
    ctx = AgentContext(load_config(None, run_dirs=[str(run.root)]))
    return collector(ctx, "ranks")


def _job(tmp_path, *, record: bool = True, b_beat_ago: float = 0.0, b_state: str = "running",
         a_waiting: float = 0.0):
    run = RunDir(tmp_path / "shared" / "exp").create()
    if record:
        run.write_run_info({"job": "exp", "world_size": 4, "nnodes": 2})
    now = time.time()
    for rank, node in ((0, "gpu-a"), (1, "gpu-a"), (2, "gpu-b"), (3, "gpu-b")):
        at = now - (b_beat_ago if node == "gpu-b" else 0.0)
        write_status(run, rank, os.getpid(), node=node, world_size=4, local_rank=rank % 2,
                     heartbeat_at=at, last_progress_at=at - (a_waiting if node == "gpu-a" else 0),
                     state=b_state if node == "gpu-b" else "running")
    return run


def _silent(result) -> dict[str, float]:
    return {dict(k)["node"]: v for k, v in
            samples(result, "trainwatch_run_node_silent_seconds").items()}


def test_a_lost_nodes_ranks_are_expected_and_its_node_named_by_the_others(tmp_path,
                                                                         monkeypatch):
    run = _job(tmp_path, b_beat_ago=60.0)
    result = _agent(run, "gpu-a", monkeypatch).collect()
    assert value(result, "trainwatch_run_ranks_expected", run="exp", node="gpu-a") == 4
    assert value(result, "trainwatch_run_ranks_reporting", run="exp", node="gpu-a") == 2
    assert _silent(result).keys() == {"gpu-b"} and 59 < _silent(result)["gpu-b"] < 120
    # Up is still this node's only: the lost node's ranks are not claimed.
    assert sorted(dict(k)["rank"] for k in samples(result, "trainwatch_rank_up")) == ["0", "1"]
    view = result.data["jobs"][0]["view"]
    assert view["expected_ranks"] == 4 and view["reporting_ranks"] == 2
    assert list(view["silent_nodes"]) == ["gpu-b"]


def test_a_node_whose_ranks_beat_is_not_silent_whoever_exports_them(tmp_path, monkeypatch):
    """Only gpu-b's agent died: its ranks still write their statuses, so the job's ranks
    all report (TrainwatchAgentDown's, not a missing rank)."""
    run = _job(tmp_path)
    result = _agent(run, "gpu-a", monkeypatch).collect()
    assert value(result, "trainwatch_run_ranks_reporting", run="exp", node="gpu-a") == 4
    assert _silent(result) == {}


def test_ranks_that_ended_cleanly_are_accounted_for(tmp_path, monkeypatch):
    run = _job(tmp_path, b_beat_ago=600.0, b_state="finished")
    result = _agent(run, "gpu-a", monkeypatch).collect()
    assert value(result, "trainwatch_run_ranks_reporting", run="exp", node="gpu-a") == 4
    assert _silent(result) == {}


def test_without_run_json_the_ranks_world_size_is_expected(tmp_path, monkeypatch):
    run = _job(tmp_path, record=False)
    result = _agent(run, "gpu-b", monkeypatch).collect()
    assert value(result, "trainwatch_run_ranks_expected", run="exp", node="gpu-b") == 4


def test_another_hosts_clock_only_matters_on_the_first_look(tmp_path, monkeypatch):
    """gpu-b's clock is 5 minutes behind: its ranks look silent at the first look, and
    report once their heartbeat is seen to move."""
    run = _job(tmp_path, b_beat_ago=300.0)
    ranks = _agent(run, "gpu-a", monkeypatch)
    assert _silent(ranks.collect()).keys() == {"gpu-b"}
    for rank in (2, 3):
        at = time.time() - 299.0
        write_status(run, rank, os.getpid(), node="gpu-b", world_size=4, local_rank=rank % 2,
                     heartbeat_at=at, last_progress_at=at)
    result = ranks.collect()
    assert _silent(result) == {}
    assert value(result, "trainwatch_run_ranks_reporting", run="exp", node="gpu-a") == 4


def test_a_run_none_of_whose_ranks_published_expects_nothing(tmp_path, monkeypatch):
    """Starting, or a command without the telemetry library: not missing ranks."""
    run = RunDir(tmp_path / "exp").create()
    run.write_run_info({"job": "exp", "world_size": 4, "nnodes": 2})
    result = _agent(run, "gpu-a", monkeypatch).collect()
    assert not samples(result, "trainwatch_run_ranks_expected")
    assert not samples(result, "trainwatch_run_ranks_reporting")


def test_a_run_directory_per_node_expects_nothing(tmp_path, monkeypatch):
    """Each node's run directory holds only its own ranks: this agent cannot see the job,
    and its world size against this node's ranks would page every healthy job (an
    embedded engine scrapes only its own agent)."""
    run = RunDir(tmp_path / "node-a" / "exp").create()
    for rank in (0, 1):
        write_status(run, rank, os.getpid(), node="gpu-a", world_size=4, local_rank=rank)
    result = _agent(run, "gpu-a", monkeypatch).collect()
    assert not samples(result, "trainwatch_run_ranks_expected")
    run.write_run_info({"job": "exp", "world_size": 2, "nnodes": 1})  # a one-node job
    result = _agent(run, "gpu-a", monkeypatch).collect()
    assert value(result, "trainwatch_run_ranks_expected", run="exp", node="gpu-a") == 2


@pytest.mark.parametrize("b_state, kind", [("failed", "dead"), ("running", "frozen")])
def test_a_stall_that_waits_for_another_nodes_down_rank_names_it(tmp_path, monkeypatch,
                                                                  b_state, kind):
    """gpu-a's ranks wait (heartbeats fresh, no step for 10 minutes) for gpu-b's, which
    failed or stopped beating: gpu-a's incident names them and their node, where it had
    said culprit "unknown" (an embedded engine sees only its own node's agent: its stall
    alert named no culprit when a rank on another node died)."""
    run = _job(tmp_path, b_beat_ago=60.0, b_state=b_state, a_waiting=600.0)
    ranks = _agent(run, "gpu-a", monkeypatch)
    publish(ranks.ctx, "ranks", ranks.collect())
    result = collector(ranks.ctx, "findings").collect()
    (incident,) = [f for f in result.data["findings"] if f["kind"] == "stall_incident"]
    assert incident["culprit_ranks"] == [2, 3] and incident["waiting_ranks"] == [0, 1]
    assert incident["culprit_node"] == "gpu-b" and incident["stall_kind"] == kind, incident
    said = {"dead": "rank 2 on node gpu-b failed", "frozen": "rank 2 on node gpu-b stopped"}
    assert said[kind] in incident["message"], incident["message"]
    assert "torchrun restarts the job" in incident["message"] or kind == "frozen"
    # One series per culprit, under its node: the same as gpu-b's own agent would export.
    (labels,) = samples(result, "trainwatch_stall_incident_seconds")
    assert dict(labels) == {"run": "exp", "node": "gpu-b", "culprit_rank": "2", "kind": kind}
