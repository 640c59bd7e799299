"""The multi-node drills' own criterion: one failure is repaired once, everywhere. Every
node that is still there restarted its workers exactly once after the fault (one
re-rendezvous, not one per node or per rank); a lost node restarted nothing."""

from __future__ import annotations

from typing import Any, Sequence

from trainwatch.drill.catalog import NODE_LOST, Drill
from trainwatch.rundir.attempts import rank_of

CRITERIA = ("restarted once on every node",)


def applies(drill: Drill) -> bool:
    return drill.nnodes > 1


def restarts_by_node(record: dict[str, Any], events: Sequence[dict[str, Any]],
                     t0: float) -> list[dict[str, Any]]:
    """Per node of the drill's record: the ranks started after the fault and the restarts
    they make (distinct torchrun restart counts: one generation of workers each)."""
    nodes = [n.get("name") for n in record.get("nodes") or [] if isinstance(n, dict)]
    started = [e for e in events if e["event"] == "rank_started" and e["time"] > t0]
    out = []
    for name in nodes:
        mine = [e for e in started if e.get("host") == name]
        counts = sorted({int(e["restart_count"]) for e in mine
                         if isinstance(e.get("restart_count"), int)})
        out.append({"node": name, "restarts": len(counts), "restart_counts": counts,
                    "ranks": sorted({r for e in mine if (r := rank_of(e)) is not None})})
    return out


def criteria(drill: Drill, nodes: list[dict[str, Any]], fault: dict[str, Any]
             ) -> list[dict[str, Any]]:
    lost = fault.get("node") if drill.node_fault == NODE_LOST else None
    problems, said = [], []
    for node in nodes:
        expected = 0 if node["node"] == lost else 1
        text = (f"{node['node']}: lost, no restart" if node["node"] == lost and not
                node["restarts"] else f"{node['node']}: {node['restarts']} restart"
                f"{'s' if node['restarts'] != 1 else ''} (ranks "
                f"{', '.join(map(str, node['ranks'])) or 'none'})")
        said.append(text)
        if node["restarts"] != expected:
            problems.append(f"{text}, expected {expected}")
    if not nodes:
        return [{"name": CRITERIA[0], "passed": False,
                 "detail": "the drill's record names no nodes"}]
    return [{"name": CRITERIA[0], "passed": not problems,
             "detail": "; ".join(problems) if problems else "; ".join(said)}]
