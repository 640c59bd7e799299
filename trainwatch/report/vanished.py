"""Ranks that are gone without a last word: their status still says ``running`` but their
process is not there.

Under ``trainwatch run`` the supervisor journals how a job ended; a plain ``torchrun``
leaves only the ranks' own files, and a SIGKILLed rank (or one whose peers were torn down
with it) never writes its final state. Its process can still be looked for on the node it
ran on; on another node it cannot, and such a rank is not counted.
"""

from __future__ import annotations

from typing import Any

from trainwatch.host.procinfo import still_running
from trainwatch.node import node_name


def vanished(statuses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{rank, pid, step, heartbeat_at}`` of each rank of this node that says running but
    is gone, the one whose heartbeat stopped first first."""
    here, gone = node_name(), []
    for s in statuses:
        if s.get("state") != "running" or s.get("node") != here or still_running(s) is not False:
            continue
        beat = s.get("heartbeat_at")
        gone.append({"rank": s.get("rank"), "pid": s["pid"], "step": s.get("step"),
                     "heartbeat_at": beat if isinstance(beat, (int, float)) else None})
    # the first to fall silent first: likely the one that failed, the others torn down after
    return sorted(gone, key=lambda x: (x["heartbeat_at"] is None, x["heartbeat_at"] or 0.0))
