"""A rank of the job died and torchrun is restarting the workers: a stall action waits.

When a rank dies (SIGKILL, an exception, the OOM killer), its peers stop stepping: they
wait in a collective, or fail on the closed connection and wait for their torchrun to stop
them. The agent sees a job that does not step and the stall alert may fire, on any node,
while every node's torchrun is already tearing its workers down for one re-rendezvous.
A stall repair then is a second restart racing the first (on a bigger job: a killed
re-rendezvous, or the restarted workers killed). So before a stall action kills anything,
the controller looks for a failure of the current workers that torchrun handles, from
evidence that is not the agent's reading of the status files' steps:

* a rank's status (any node: the run directory is shared) says ``failed`` (it raised);
* a rank's node journaled its ``TrainingRankDown`` (that node's agent saw the process gone)
  after the rank's current process started;
* this node's look at its ranks (control/confirm.py) found one gone: it exited.

Only while this node's launcher runs (torchrun restarts within its own ``--max-restarts``;
a launcher that exits is the supervisor's) and for ``RESTART_ROUND_SECONDS`` after the
failure: a torchrun that never restarts its workers (itself stuck) is a stall again.
"""

from __future__ import annotations

import time
from typing import Any

from trainwatch.contract.states import FAILED
from trainwatch.rundir.run_dir import RunDir

# torchrun's own teardown (SIGTERM to the workers, up to 30 s of grace) and re-rendezvous
# take well under this; a failure older than it no longer holds a stall action back.
RESTART_ROUND_SECONDS = 90.0
# The alert a rank's node raises when it sees that rank's process gone (alerts/rules.yaml).
RANK_DOWN_ALERT = "TrainingRankDown"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _failed_statuses(statuses: list[dict[str, Any]], now: float) -> str | None:
    for status in sorted(statuses, key=lambda s: str(s.get("rank"))):
        since = _number(status.get("phase_since"))
        if status.get("state") == FAILED and since is not None \
                and now - since < RESTART_ROUND_SECONDS:
            return (f"rank {status.get('rank')} on {status.get('node') or 'its node'} failed "
                    f"{max(0.0, now - since):.1f} s ago (its status)")
    return None


def _rank_down(run: RunDir, statuses: list[dict[str, Any]], now: float) -> str | None:
    started = {s.get("rank"): _number(s.get("started_at")) for s in statuses}
    for event in reversed(run.events("alert_firing")):
        at, labels = _number(event.get("time")), event.get("labels")
        if event.get("alert") != RANK_DOWN_ALERT or at is None or not isinstance(labels, dict):
            continue
        if now - at >= RESTART_ROUND_SECONDS:
            break  # the journal is in time order: the rest is older still
        rank = labels.get("rank")
        since = started.get(int(rank)) if isinstance(rank, str) and rank.isdigit() else None
        if since is not None and at > since:  # about the rank's current process
            return (f"rank {rank} is down ({RANK_DOWN_ALERT} from "
                    f"{labels.get('node') or event.get('host')}, {max(0.0, now - at):.1f} s ago)")
    return None


def _gone(looks: dict[Any, dict[str, Any]] | None) -> str | None:
    for rank, facts in sorted((looks or {}).items(), key=lambda item: str(item[0])):
        if isinstance(facts, dict) and facts.get("process") == "gone":
            return f"rank {rank} (pid {facts.get('pid')}) exited"
    return None


def failure_under_way(run: RunDir, *, launcher_alive: bool,
                      looks: dict[Any, dict[str, Any]] | None = None,
                      now: float | None = None) -> str | None:
    """Why a stall action must leave the job to torchrun now, or None. ``looks``: the
    controller's last look at this node's ranks ({rank: facts}, control/confirm.py)."""
    if not launcher_alive:
        return None
    now = time.time() if now is None else now
    statuses = [s for s in run.statuses().records if isinstance(s.get("rank"), int)]
    found = _gone(looks) or _failed_statuses(statuses, now) or _rank_down(run, statuses, now)
    if found is None:
        return None
    return (f"{found} and this node's torchrun is restarting the workers: left to torchrun "
            f"(it restarts every node's workers in one re-rendezvous)")
