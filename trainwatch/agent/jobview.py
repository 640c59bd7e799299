"""The job-wide view from the run's own record: how many ranks the run expects, how many
still report, and which nodes went silent.

Each agent exports only the ranks whose process runs on its node (``Ranks._local``), so
when a node is lost its ranks' series vanish with its agent, and "ranks up" would read
0 of 2 where the job has 4. The run's record says what is expected: run.json's world
size (else the world size its ranks' statuses carry). Where the run directory is shared
(cluster storage), every agent also sees every node's status and beat files: a node none
of whose ranks wrote a status within ``stall.heartbeat_stale_seconds`` (and not all
finished or stopped cleanly) stopped reporting, and the agents that remain name it
(``trainwatch_run_node_silent_seconds``); a node whose agent alone died still shows its
ranks beating (``trainwatch_run_ranks_reporting``), so TrainingRanksMissing does not page
for what TrainwatchAgentDown says. An agent whose run directory holds only its own node's
ranks of a multi-node job (a run directory per node) cannot see the job and exports no
expectation. Another node's rank that failed or stopped beating while it runs is listed
(``down_elsewhere``): when this node's ranks stall waiting for it, the stall incident names
it (``agent/culprit_elsewhere.py``). Ages are the ranks collector's observations (``RanksCollector._age``):
another host's wall clock only matters on the first look.
"""

from __future__ import annotations

from typing import Any, Callable

from trainwatch.agent.registry import Result
from trainwatch.contract.states import FAILED, RUNNING

# Ranks that ended cleanly have nothing to report: they are accounted for.
_ENDED = ("finished", "stopped")
# (a key of the observation, a wall-clock time) -> its age as observed (RanksCollector._age)
Age = Callable[[tuple, float | None], float | None]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def expected_ranks(info: dict[str, Any], records: list[dict[str, Any]]) -> int | None:
    """The run's world size: run.json's, else the largest its ranks' statuses carry."""
    declared = _int(info.get("world_size"))
    if declared is not None:
        return declared
    worlds = [w for r in records if (w := _int(r.get("world_size"))) is not None]
    return max(worlds) if worlds else None


def _job_wide(info: dict[str, Any], records: list[dict[str, Any]], node: str,
              expected: int) -> bool:
    """Does this agent's view of the run directory hold the whole job? Not when the job
    spans several nodes, or expects more ranks than published a status, and every status
    it holds is this node's: a run directory of its own per node, where another node's
    ranks are never seen (compared with the ranks this node alone reports, the world size
    would page every healthy job: an embedded engine sees only its own agent), or ranks
    still starting, or a job whose telemetry runs on some ranks only. Such an agent does
    not say what it expects."""
    nodes = {str(r.get("node") or node) for r in records}
    several = (_int(info.get("nnodes")) or 1) > 1 or expected > len(records)
    return not several or nodes != {node}


def _heartbeat(record: dict[str, Any], beat: dict[str, Any] | None) -> float | None:
    """The newest heartbeat of a rank's process: its beat's when the beat is that process's."""
    for source in (beat if beat and beat.get("pid") == record.get("pid") else None, record):
        value = (source or {}).get("heartbeat_at")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def observe(result: Result, *, run_key: str, job: str, node: str, info: dict[str, Any],
            records: list[dict[str, Any]], beats: dict[int, dict[str, Any] | None],
            age: Age, stale_seconds: float) -> dict[str, Any]:
    """Export the run's expected and reporting ranks and its silent nodes; the same facts
    for /status (``jobs[].view``). A run none of whose ranks published a status exports
    none: one still starting, or a job that does not use the telemetry library (a
    ``trainwatch run -- COMMAND`` of its own), is not missing ranks."""
    if not records:
        return {"expected_ranks": None, "reporting_ranks": 0, "silent_nodes": {},
                "down_elsewhere": []}
    expected = expected_ranks(info, records)
    if expected is not None and not _job_wide(info, records, node, expected):
        expected = None
    reporting = 0
    down: list[dict[str, Any]] = []  # other nodes' ranks that failed or stopped beating
    nodes: dict[str, list[float | None]] = {}  # node -> ages of its unfinished, silent ranks
    quiet: dict[str, bool] = {}                # node -> none of its ranks reports
    for record in records:
        beat = beats.get(record["rank"])
        state = (beat or {}).get("state") or record.get("state") or "running"
        where = str(record.get("node") or node)
        heartbeat_age = age((run_key, record["rank"], record.get("pid"), "job_view"),
                            _heartbeat(record, beat))
        fresh = heartbeat_age is not None and heartbeat_age <= stale_seconds
        if where != node and (state == FAILED or (state == RUNNING and not fresh)):
            down.append({"rank": record["rank"], "node": where, "state": state,
                         "heartbeat_age": heartbeat_age})
        if state in _ENDED or fresh:
            reporting += 1
            quiet[where] = False
            continue
        quiet.setdefault(where, True)
        nodes.setdefault(where, []).append(heartbeat_age)
    silent = {where: min((a for a in nodes[where] if a is not None), default=None)
              for where, is_quiet in sorted(quiet.items()) if is_quiet}
    if expected is not None:
        result.add("trainwatch_run_ranks_expected", expected, run=job, node=node)
    result.add("trainwatch_run_ranks_reporting", reporting, run=job, node=node)
    for where, seconds in silent.items():
        result.add("trainwatch_run_node_silent_seconds", seconds, run=job, node=where)
    return {"expected_ranks": expected, "reporting_ranks": reporting,
            "silent_nodes": silent, "down_elsewhere": down}
