"""A run's attempts and restarts: one definition for diagnose, report and their words.

An attempt is one generation of rank processes, seen in the journal's ``rank_started``
events: a new one begins when a rank starts again or torchrun's restart count changes.
torchrun's count (TORCHELASTIC_RESTART_COUNT) is per torchrun, so it starts at 0 again when
the controller starts a new torchrun: counting torchrun's ``restarted`` events (or reading a
rank's ``restart_count``) misses every controller restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainwatch.contract.layout import rank_of_source

TORCHRUN, CONTROLLER, RERUN = "torchrun", "controller", "rerun"
RESTARTED_BY = (TORCHRUN, CONTROLLER, RERUN)
_BY_TEXT = {TORCHRUN: "by torchrun", CONTROLLER: "by the controller", RERUN: "run again"}


@dataclass
class Generation:
    started_at: float                      # its first rank_started
    restart_count: int | None              # torchrun's TORCHELASTIC_RESTART_COUNT
    restarted_by: str | None               # None for the first; else one of RESTARTED_BY
    ranks: dict[int, int | None] = field(default_factory=dict)  # rank -> pid
    # host -> its torchrun's count: each node has a torchrun of its own, whose counts need
    # not agree (one node's launcher replaced, the other's restarting its workers)
    counts: dict[Any, int | None] = field(default_factory=dict)


def rank_of(event: dict[str, Any]) -> int | None:
    rank = event.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        return rank
    return rank_of_source(str(event.get("source", "")))


def _time(event: dict[str, Any]) -> float | None:
    t = event.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        return None
    return float(t)


def generations(events: list[dict[str, Any]]) -> list[Generation]:
    """The attempts in journal ``events`` (any order; events without a time are left out).

    A restart is the controller's when the controller journaled a ``job_started`` of a
    later attempt since the previous start, torchrun's when its restart count is above 0, else
    the run was started again (by hand, a new ``trainwatch run`` or ``train``).

    A multi-node job is one job: its nodes' ranks start in one attempt, in any order, each
    node under a torchrun of its own. A new attempt begins when a rank starts again, or
    when a node's torchrun count changes from what that node's ranks started with in this
    attempt (the journal's ``host``); two nodes whose counts differ are one attempt."""
    timed = sorted(((t, e) for e in events if (t := _time(e)) is not None),
                   key=lambda pair: pair[0])
    found: list[Generation] = []
    controller_start = False
    for t, e in timed:
        attempt = e.get("attempt")
        if (e.get("event") == "job_started" and isinstance(attempt, int)
                and not isinstance(attempt, bool) and attempt > 1):
            controller_start = True
        if e.get("event") != "rank_started" or (rank := rank_of(e)) is None:
            continue
        count = e.get("restart_count")
        restart = count if isinstance(count, int) and not isinstance(count, bool) else None
        host = e.get("host")
        current = found[-1] if found else None
        if current is None or rank in current.ranks \
                or current.counts.get(host, restart) != restart:
            # A controller's start since the last attempt decides: on several nodes the
            # other nodes' torchruns restart their workers (count above 0) for it too.
            by = (None if current is None else CONTROLLER if controller_start
                  else TORCHRUN if (restart or 0) > 0 else RERUN)
            current = Generation(t, restart, by)
            found.append(current)
            controller_start = False
        current.counts.setdefault(host, restart)
        pid = e.get("pid")
        current.ranks[rank] = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
    return found


def summary(restarted_by: list[str | None]) -> dict[str, Any]:
    """Attempts and restarts by whom, from each attempt's ``restarted_by`` in order."""
    restarts = {by: sum(1 for b in restarted_by if b == by) for by in RESTARTED_BY}
    return {"attempts": len(restarted_by), "restarts": sum(restarts.values()),
            "restarted_by": restarts}


def describe(counts: dict[str, Any]) -> str:
    """The words every command uses: 'attempts 3 (2 restarts: 1 by torchrun, 1 by the
    controller)'."""
    n = counts["restarts"]
    if not counts["attempts"]:
        return "attempts unknown (no rank_started in the journal)"
    if not n:
        return f"attempts {counts['attempts']} (no restarts)"
    parts = [f"{k} {_BY_TEXT[by]}" for by, k in counts["restarted_by"].items() if k]
    return (f"attempts {counts['attempts']} ({n} restart{'s' if n != 1 else ''}: "
            f"{', '.join(parts)})")
