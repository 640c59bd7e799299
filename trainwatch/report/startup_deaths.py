"""A supervisor that died while no rank of its ran: an incident of its own, not an attempt's.

``trainwatch run`` (or ``trainwatch train``) SIGKILLed in its start-up, before any rank
started, or while it restarted the job after the ranks of an attempt had ended, leaves
nothing but the next supervisor's ``supervisor_died`` event. Incidents are otherwise
attempt ends: such a death fell before the first attempt (and was dropped) or into an
attempt that had already ended (and was read as that attempt's end: "the job stopped with
it"). Each becomes its own incident, so the on-call engineer reads that a supervisor died.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from trainwatch.report.not_running import LAUNCHER_ROLE, job_evidence


def job_at(attempt_events: Sequence[dict[str, Any]], died_at: float,
           terminal: tuple[str, ...]) -> str:
    """Where the attempt's job was when its supervisor died at ``died_at``: ``"before"``
    it started (no rank's, launcher's or ``job_started`` event by then: a run read as one
    attempt from its first event), ``"after"`` it ended (an end event of its own by then),
    else ``"running"``: the death was the attempt's own end, its job going with it."""
    before = [e for e in attempt_events if e["time"] <= died_at]
    if any(e["event"] in terminal for e in before):
        return "after"
    started = any(e["event"] == "job_started" or job_evidence(e) for e in before)
    return "running" if started else "before"


def startup_cause(event: dict[str, Any], after_attempt: int | None) -> str:
    """One human line: who died, when in the run's life, and that nothing of the job ran."""
    previous = event.get("previous")
    previous = previous if isinstance(previous, dict) else {}
    who = ("the launcher `trainwatch train`" if previous.get("role") == LAUNCHER_ROLE
           else "the supervisor `trainwatch run`")
    node = event.get("node")
    where = f" of node {node}" if node is not None else ""
    when = ("in its start-up, before any rank started" if after_attempt is None
            else f"after attempt {after_attempt} had ended, before any rank of a new "
                 "attempt started")
    return (f"{who}{where} (pid {previous.get('pid', '?')}) died without a word (SIGKILL, a "
            f"crash or an OOM kill; found by the next supervisor) {when}: no step was lost, "
            "nothing ran until the next start")


@dataclass
class StartupDeath:
    """A ``supervisor_died`` event that no attempt's end was: when the supervisor died (its
    last heartbeat, else when the next one found it dead) and the attempt that had ended
    before it (None: before the first)."""

    event: dict[str, Any]
    time: float
    after_attempt: int | None
