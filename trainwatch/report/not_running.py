"""When nothing held the job's accelerators: no launcher and no supervisor alive.

A stopped run relaunched later is not billed for the pause, and neither is the time after
a supervisor died with its whole job (``kill -9`` of the process group, a node reboot)
until someone started it again: the next supervisor journals ``supervisor_died`` with the
dead one's last heartbeat (rundir/runlock.py), and from then on nothing ran. Silence after
that death is never a stall, which means ranks alive and not progressing.
"""

from __future__ import annotations

import bisect
from typing import Any, Mapping, Sequence

from trainwatch.rundir.attempts import rank_of

# The lock holder that is itself the launcher (no controller): `trainwatch train` by hand.
LAUNCHER_ROLE = "trainwatch train"


def death_time(event: dict[str, Any]) -> float | None:
    """When the supervisor a ``supervisor_died`` event names died: its last heartbeat, when
    it wrote one (no later than the event: another clock is not evidence); else None."""
    at = event.get("last_beat_at")
    if isinstance(at, (int, float)) and not isinstance(at, bool) and at <= event["time"]:
        return float(at)
    return None


def supervisor_deaths(events: Sequence[dict[str, Any]], step_ends: Any = ()
                      ) -> dict[int, float]:
    """When the job of each supervisor found dead (``supervisor_died``, by the event's
    ``id``) was last known alive: the later of the supervisor's last heartbeat (else when
    it took the lock) and the job's last sign of life before the next supervisor found it
    dead (a rank's or the launcher's event, a step's end: the beat is a second apart, and
    a job killed with its supervisor can step once more). ``step_ends``: rank 0's step
    end times, sorted (StepLog.end)."""
    found: dict[int, float] = {}
    died_events = [e for e in events if e["event"] == "supervisor_died"]
    if not died_events:
        return found
    times = sorted(e["time"] for e in events if job_evidence(e))
    for e in died_events:
        since = _previous(e).get("since")
        died = death_time(e)
        if died is None and isinstance(since, (int, float)) and not isinstance(since, bool) \
                and since <= e["time"]:
            died = float(since)
        seen = [column[k] for column in (times, step_ends)
                if (k := bisect.bisect_left(column, e["time"]) - 1) >= 0]
        found[id(e)] = max(seen + ([] if died is None else [died]), default=e["time"])
    return found


def _previous(event: dict[str, Any]) -> dict[str, Any]:
    """The dead holder's lock record a ``supervisor_died`` event carries ({} if none)."""
    previous = event.get("previous")
    return previous if isinstance(previous, dict) else {}


def job_evidence(event: dict[str, Any]) -> bool:
    """An event written by the job's own processes (a rank, the launcher): proof it ran."""
    return rank_of(event) is not None or event.get("source") == "launcher"


# The events that start or end a launcher's or a controller's session.
_SESSION_EVENTS = ("launcher_started", "launcher_exited", "job_stopped", "job_exited",
                   "job_started", "controller_started", "controller_stopped", "supervisor_died")


def not_running(events: Sequence[dict[str, Any]], start: float, end: float,
                deaths: Mapping[int, float], step_ends: Any = ()
                ) -> list[tuple[float, float]]:
    """Intervals when no launcher and no controller session was alive (a stopped run
    relaunched later, a supervisor killed with its job): nothing held accelerators then.

    A launcher is alive from its ``launcher_started`` until its ``launcher_exited`` (same
    host) or, for a job the controller ran, its ``job_stopped``/``job_exited`` (same pid: a
    killed launcher journals nothing). One that vanished without either stays alive,
    unless the next supervisor found its supervisor dead: ``deaths`` maps each such
    ``supervisor_died`` event (by ``id``) to when it died, and that death ends the dead
    supervisor's session and the launchers it started. An interval never holds the job's
    own evidence (a rank's event or step, a launcher's event): the job ran until its last.
    """
    # Other events change no session: left out (a save's, every few minutes of a run)
    order = sorted((e for e in events if e["event"] in _SESSION_EVENTS),
                   key=lambda e: deaths.get(id(e), e["time"]))
    launchers: list[tuple[Any, Any]] = []          # (host, pid) of live launchers
    jobs: list[tuple[float, Any, Any]] = []        # (time, host, pid) of job_started
    controllers = 0
    idle_since: float | None = None
    intervals = []
    for e in order:
        at = deaths.get(id(e), e["time"])
        was_running = bool(launchers) or controllers > 0
        name, host, pid = e["event"], e.get("host"), e.get("pid")
        if name == "launcher_started":
            launchers.append((host, pid))
        elif name == "launcher_exited":
            mine = [x for x in launchers if x[0] == host]
            if mine:
                launchers.remove(mine[-1])
        elif name in ("job_stopped", "job_exited"):
            launchers = [x for x in launchers if x[1] != pid]
        elif name == "job_started":
            jobs.append((e["time"], host, pid))
        elif name == "controller_started":
            controllers += 1
        elif name == "controller_stopped":
            controllers = max(0, controllers - 1)
        elif name == "supervisor_died" and id(e) in deaths:
            launchers, controllers = _died(e, launchers, jobs, controllers)
        running = bool(launchers) or controllers > 0
        if was_running and not running:
            idle_since = at
        elif running and not was_running and idle_since is not None:
            a, b = max(idle_since, start), min(at, end)
            if b > a:
                intervals.append((a, b))
            idle_since = None
    return _after_the_job(intervals, events, step_ends)


def _died(event: dict[str, Any], launchers: list[tuple[Any, Any]],
          jobs: list[tuple[float, Any, Any]], controllers: int
          ) -> tuple[list[tuple[Any, Any]], int]:
    """The live launchers and controller sessions once the supervisor ``event`` names had
    died: a `trainwatch train` holder is its own launcher; a controller's session ends,
    with the launchers of the jobs it started since it took the lock."""
    previous = _previous(event)
    host, pid, since = previous.get("host"), previous.get("pid"), previous.get("since")
    if previous.get("role") == LAUNCHER_ROLE:
        return [x for x in launchers if x[1] != pid], controllers
    since = since if isinstance(since, (int, float)) and not isinstance(since, bool) else None
    started = {p for t, h, p in jobs if h == host and (since is None or t >= since)}
    return [x for x in launchers if x[1] not in started], max(0, controllers - 1)


def _after_the_job(intervals: list[tuple[float, float]], events: Sequence[dict[str, Any]],
                   step_ends: Any) -> list[tuple[float, float]]:
    """Each interval from the job's last evidence inside it on (a job that outlived its
    supervisor, then stopped), and none where it ran to the end."""
    if not intervals:
        return intervals
    times = sorted(e["time"] for e in events if job_evidence(e))
    kept = []
    for a, b in intervals:
        last = a
        for column in (times, step_ends):
            k = bisect.bisect_left(column, b) - 1
            if k >= 0 and column[k] > last:
                last = column[k]
        if b > last:
            kept.append((last, b))
    return kept
