"""The network under the job's collectives, as the kernel sees it: for every rank process
this host runs, its TCP connections (gloo's, the stores') with each one's round-trip time
now (``rtt``), its best (``min_rtt``, the kernel's windowed minimum: how fast the link was)
and its retransmissions (trainwatch/host/tcp_diag.py), and, per node (network namespace),
which interface holds each address and how its egress queue shapes it
(trainwatch/host/link_queues.py).

Fills ``Evidence.node_network``; the rule is rules/slow_link.py. A rank is read only when its
pid is still the rank's process (not reused). Ranks in another network namespace than
diagnose's (a node per namespace or container on this machine) need root to enter it;
without, that is said, not guessed.
"""

from __future__ import annotations

from typing import Any

import psutil

from trainwatch.diagnose.model import Evidence
from trainwatch.diagnose.node_cpu import slowdown
from trainwatch.host.link_queues import node_links
from trainwatch.host.netns_call import call_in_netns, netns_id
from trainwatch.host.procinfo import reused
from trainwatch.host.tcp_diag import socket_inodes, tcp_sockets
from trainwatch.rundir.run_dir import RunDir

KEPT = ("src", "sport", "dst", "dport", "rtt_ms", "min_rtt_ms", "rttvar_ms", "total_retrans",
        "last_data_sent", "last_data_recv", "bytes_acked")


def _own_pids(ev: Evidence) -> dict[int, int]:
    """rank -> pid of the running ranks whose process this host runs."""
    out = {}
    for rank, view in ev.ranks.items():
        pid = view.get("pid")
        if view.get("state") != "running" or not isinstance(pid, int):
            continue
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            continue
        if not reused(created, view.get("started_at"), view.get("process_created_at")):
            out[rank] = pid
    return out


def gather(run: RunDir, ev: Evidence) -> None:
    pids = _own_pids(ev)
    by_netns: dict[str, list[int]] = {}
    for rank, pid in pids.items():
        ns = netns_id(pid)
        if ns is not None:
            by_netns.setdefault(ns, []).append(rank)
    nodes: dict[str, Any] = {}
    for ns, ranks in by_netns.items():
        node = str(ev.ranks[ranks[0]].get("node") or "?")
        pid = pids[ranks[0]]
        try:
            links = node_links(pid)
            sockets = call_in_netns(pid, tcp_sockets)
        except OSError as exc:
            ev.cannot_see(f"TCP connections of the ranks on {node} ({ns}): {exc}")
            continue
        mine = []
        for rank in ranks:
            inodes = socket_inodes(pids[rank])
            mine += [{"rank": rank, **{k: s.get(k) for k in KEPT}}
                     for s in sockets if s["inode"] in inodes]
        nodes[node] = {"netns": ns, "ranks": sorted(ranks), **links, "sockets": mine}
    if nodes:  # and how much the ranks slowed against their own earlier steps
        ev.node_network = {"nodes": nodes,
                           "slowdown": {r: slowdown(run, r) for n in nodes.values()
                                        for r in n["ranks"]}}
