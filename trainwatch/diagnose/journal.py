"""Attempts and restarts (trainwatch/attempts.py), firing alerts, checkpoint failures and
actions from journal.jsonl."""

from __future__ import annotations

from typing import Any

from trainwatch import attempts
from trainwatch.contract.stall import recorded_options
from trainwatch.diagnose.model import Evidence
from trainwatch.rundir import RunDir

RECENT = 200
_INTERESTING = ("restarted", "launcher_exited", "failed", "checkpoint_saved", "checkpoint_failed",
                "checkpoint_fallback", "nonfinite_detected", "alert_firing", "alert_resolved",
                "action_taken", "finished")


def gather(run: RunDir, ev: Evidence) -> None:
    result = run.journal()
    ev.skipped += [str(s) for s in result.skipped]
    if not run.journal_file.exists():
        ev.cannot_see(f"journal ({run.journal_file} does not exist)")
    events = [r for r in result.records[-RECENT:] if r.get("event") in _INTERESTING]
    ev.journal = {"events": events, "restarts": attempts.summary(
                      [g.restarted_by for g in attempts.generations(result.records)]),
                  "firing_alerts": firing(result.records),
                  "stall_options": recorded_options(result.records)}


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
