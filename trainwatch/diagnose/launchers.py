"""Each node's launcher as the one journal tells it: when it started, whether it exited
(and how), whether any rank started under it since, and the job's starts (``job_started``).

On several nodes every launcher writes to the same journal, each event naming its host,
so diagnose on any node sees every node's launcher: a launcher that exited on another
node, or one that started and waits in the rendezvous for nodes that never came.
"""

from __future__ import annotations

import math
from typing import Any


def _time(record: dict[str, Any]) -> float | None:
    t = record.get("time")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) \
        and math.isfinite(t) else None


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0 else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``hosts``: each host's newest launcher (started_at, pid, node_rank, exited_at,
    exit_code, signal, ranks_started_at: its newest rank start since the launcher
    started, monitor_interval: how often its torchrun polls the workers, when it says),
    by node rank; ``nnodes``: the most any launcher was started for;
    ``job_started``: the newest ``job_started`` (attempt, host, time)."""
    hosts: dict[str, dict[str, Any]] = {}
    nnodes, job = None, None
    for t, record in sorted(((t, r) for r in records if (t := _time(r)) is not None),
                            key=lambda pair: pair[0]):
        event, host = record.get("event"), str(record.get("host") or "?")
        if event == "launcher_started":
            hosts[host] = {"host": host, "started_at": t, "pid": _int(record.get("pid")),
                           "node_rank": _int(record.get("node_rank")), "exited_at": None,
                           "exit_code": None, "signal": None, "ranks_started_at": None,
                           "monitor_interval": _seconds(record.get("monitor_interval"))}
            count = _int(record.get("nnodes"))
            if count is not None:
                nnodes = max(nnodes or 0, count)
        elif event == "launcher_exited" and host in hosts:
            hosts[host].update(exited_at=t, exit_code=_int(record.get("exit_code")),
                               signal=record.get("signal") if isinstance(
                                   record.get("signal"), str) else None)
        elif event == "rank_started" and host in hosts:
            hosts[host]["ranks_started_at"] = t
        elif event == "job_started":
            job = {"time": t, "attempt": _int(record.get("attempt")), "host": host}
    ordered = sorted(hosts.values(), key=lambda h: (h["node_rank"] is None,
                                                   h["node_rank"] or 0, h["host"]))
    return {"hosts": ordered, "nnodes": nnodes, "job_started": job}
