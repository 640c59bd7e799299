"""Attempts and restarts (trainwatch/rundir/attempts.py), firing alerts, checkpoint failures,
actions and each node's launcher (diagnose/launchers.py) from journal.jsonl."""

from __future__ import annotations

import math
from typing import Any

from trainwatch.rundir import attempts
from trainwatch.contract.layout import CLOSED_EVENT
from trainwatch.contract.stall import recorded_options
from trainwatch.diagnose import launchers
from trainwatch.diagnose.model import Evidence
from trainwatch.rundir.run_dir import RunDir

RECENT = 200
_INTERESTING = ("restarted", "launcher_exited", "failed", "checkpoint_saved", "checkpoint_failed",
                "checkpoint_fallback", "checkpoint_resumed", "nonfinite_detected",
                "alert_firing", "alert_resolved", "action_taken", "finished")


def gather(run: RunDir, ev: Evidence) -> None:
    result = run.journal()
    ev.skipped += [str(s) for s in result.skipped]
    if not run.journal_file.exists():
        ev.cannot_see(f"journal ({run.journal_file} does not exist)")
    events = [r for r in result.records[-RECENT:] if r.get("event") in _INTERESTING]
    found = attempts.generations(result.records)
    ev.journal = {"events": events, "restarts": attempts.summary([g.restarted_by for g in found]),
                  "attempts": [{"started_at": g.started_at, "restarted_by": g.restarted_by,
                                "pids": dict(g.ranks),
                                "resumed_step": resumed_step(result.records, g, nxt)}
                               for g, nxt in zip(found, [*found[1:], None])],
                  "firing_alerts": firing(result.records),
                  "stall_options": recorded_options(result.records),
                  "stopped": stopped(result.records),
                  "launchers": launchers.summary(result.records)}


def stopped(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The supervisor's ``job_stopped``, or a person's ``run_closed`` (``trainwatch close``),
    when it is the job's last start, stop or exit: the run was stopped (Ctrl-C, ``systemctl
    stop``, bad input) or closed (its job gone) and not started again. A multi-node job's
    node whose job ended as another node was stopped on request (``job_exited`` with
    ``stopped_elsewhere``, control/stopped_elsewhere.py) was stopped too."""
    last = None
    for record in records:
        if record.get("event") in ("job_started", "job_stopped", "job_exited", CLOSED_EVENT):
            last = record
    elsewhere = last.get("stopped_elsewhere") if last is not None else None
    if last is None or (last.get("event") not in ("job_stopped", CLOSED_EVENT)
                        and not elsewhere) \
            or not isinstance(last.get("time"), (int, float)):
        return None
    reason = (f"node {elsewhere} was stopped on request" if elsewhere
              else str(last.get("reason") or "stopped"))
    return {"time": last["time"], "reason": reason, "closed": last.get("event") == CLOSED_EVENT,
            "event": last.get("event")}


def resumed_step(records: list[dict[str, Any]], attempt: attempts.Generation,
                 following: attempts.Generation | None) -> int | None:
    """The checkpoint step an attempt resumed from (its first checkpoint_resumed), or None."""
    end = following.started_at if following else math.inf
    for record in records:
        t, step = record.get("time"), record.get("step")
        if record.get("event") == "checkpoint_resumed" and isinstance(t, (int, float)) \
                and attempt.started_at <= t < end and isinstance(step, int) \
                and not isinstance(step, bool):
            return step
    return None


def firing(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Alerts whose last journal event is alert_firing (not yet resolved)."""
    last: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.get("event") in ("alert_firing", "alert_resolved"):
            key = str(record.get("fingerprint") or record.get("alert")
                      or record.get("alertname"))
            last[key] = record
    return [r for r in last.values() if r.get("event") == "alert_firing"]


def recent(ev: Evidence, *names: str) -> list[dict[str, Any]]:
    return [r for r in ev.journal.get("events", []) if r.get("event") in names]
