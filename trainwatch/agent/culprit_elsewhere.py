"""The culprit of a stall on another node, from the job-wide view.

When every stalled rank of this node waits alike, the culprit is elsewhere; with a shared
run directory this agent still reads the other nodes' statuses (``agent/jobview.py``).
A rank there that failed (its status says so) or stopped beating while it runs is what
this node's ranks wait for: the incident names it, and its node, instead of "unknown"
(an embedded engine sees only its own node's agent, so its alert had no culprit at all).

* failed: kind ``dead``. torchrun restarts the job (control/restart_round.py); the stall
  alerts leave a dead culprit to torchrun and TrainingRankDown (alerts/rules.yaml).
* stopped beating: kind ``frozen``, as this agent calls a rank whose heartbeat is stale
  and whose process it cannot inspect. Dead or frozen, its own node's agent tells which.

The incident's series then carry the culprit's node, as its node's agent exports them:
one alert per culprit, whichever agents saw it.
"""

from __future__ import annotations

from typing import Any

from trainwatch.agent.incident import Incident
from trainwatch.contract.states import FAILED


def _age(seconds: Any) -> str:
    return f"{seconds:.1f} s ago" if isinstance(seconds, (int, float)) else "a while ago"


def name_elsewhere(incident: Incident, down: list[dict[str, Any]]) -> None:
    """Name ``down``'s ranks (``jobview``'s ``down_elsewhere``) the culprits of an incident
    that names none on this node: the failed ones first, else those that stopped beating."""
    if incident.culprits or not down:
        return
    failed = [d for d in down if d["state"] == FAILED]
    named = sorted(failed or down, key=lambda d: d["rank"])
    first = named[0]
    incident.culprits = [d["rank"] for d in named]
    incident.node = first["node"]
    incident.ranks.update({d["rank"]: {"rank": d["rank"], "node": d["node"]} for d in named})
    if failed:
        incident.kind = "dead"
        incident.reason = (f"rank {first['rank']} on node {first['node']} failed (its status, "
                           f"last beat {_age(first['heartbeat_age'])}): torchrun restarts "
                           "the job")
    else:
        incident.kind = "frozen"
        incident.reason = (f"rank {first['rank']} on node {first['node']} stopped beating "
                           f"{_age(first['heartbeat_age'])} (dead or frozen: node "
                           f"{first['node']}'s agent tells which)")
