"""The links of nodes this host cannot see, from their agents' /status (``links``: the
links collector, trainwatch/agent/collectors/links.py): each node's ranks' connections per
address pair, its addresses and egress queues, added to ``Evidence.node_network`` beside
the nodes diagnose read itself (diagnose/node_network.py), which keep precedence.

With ``--agent`` for every node, the slow-link rule (rules/slow_link.py) sees both ends of
every link, so it can tell which end's queue holds packets back, on a cluster where
diagnose runs on one node.
"""

from __future__ import annotations

from typing import Any

from trainwatch.diagnose.model import Evidence
from trainwatch.diagnose.node_cpu import slowdown
from trainwatch.rundir.run_dir import RunDir


def _job(ev: Evidence) -> str | None:
    return (ev.run or {}).get("job") or next(
        (v.get("job") for v in ev.ranks.values() if v.get("job")), None)


def gather(run: RunDir, ev: Evidence) -> None:
    job = _job(ev)
    net = ev.node_network
    nodes: dict[str, Any] = dict(net.get("nodes") or {})
    added = []
    for agent in ev.agents:
        links = agent.get("links") if not agent.get("error") else None
        jobs = (links or {}).get("jobs") or {}
        view = jobs.get(job) if job else (next(iter(jobs.values())) if len(jobs) == 1 else None)
        for name, node in ((view or {}).get("nodes") or {}).items():
            if name not in nodes and isinstance(node, dict):
                nodes[name] = {**node, "via": f"agent {agent.get('node')}"}
                added.append(name)
        unseen = ((links or {}).get("unseen_processes") or {}).get(job) if job else None
        if unseen:
            ev.cannot_see(f"agent {agent.get('node')}: the TCP connections of {unseen} "
                          f"rank process(es) it may not read")
    if not added:
        return
    slowed = dict(net.get("slowdown") or {})
    for name in added:
        for rank in nodes[name].get("ranks") or []:
            if isinstance(rank, int) and rank not in slowed:
                slowed[rank] = slowdown(run, rank)
    ev.node_network = {**net, "nodes": nodes, "slowdown": slowed}
