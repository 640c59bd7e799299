"""Links: the network between this node's ranks and their peers, as the kernel sees the
ranks' own TCP connections (gloo's, the stores'): per peer address the RTT now, its best
and the retransmissions (trainwatch/agent/link_view.py), exported as
``trainwatch_link_*{peer}`` and published in /status (``links``) with the node's
addresses and egress queues, so ``trainwatch diagnose --agent URL`` of every node has
both ends of a slow link (diagnose/agent_links.py, rules/slow_link.py).

One netlink dump per network namespace the ranks are in and one ``/proc/PID/fd`` listing
per rank a run. A rank whose fds or namespace the agent may not read (another user's
process, another namespace without root) is skipped and counted
(``trainwatch_link_unseen_processes``), never an error. The addresses and queues
(``ip``, ``tc``) are read every ``queues_every`` seconds, and at once when a peer looks
slow.
"""

from __future__ import annotations

import time
from typing import Any

from trainwatch.agent import link_view
from trainwatch.agent.registry import Collector, Result, register
from trainwatch.host.link_queues import node_links
from trainwatch.host.netns_call import call_in_netns, netns_id
from trainwatch.host.socket_fds import SocketFds
from trainwatch.host.tcp_diag import tcp_sockets

GONE = ("gone", "zombie", "dead", "reused")
MAX_REASONS = 5


def running_ranks(ranks_data: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """(run, rank) of this node's running ranks whose process the ranks collector found."""
    out = []
    for job in (ranks_data or {}).get("jobs", []):
        for r in job.get("ranks", []):
            status = (r.get("process") or {}).get("status")
            if r.get("state") == "running" and isinstance(r.get("pid"), int) \
                    and status not in GONE:
                out.append((str(job["job"]), r))
    return out


@register("links", interval=15.0, timeout=10.0, first_delay=2.0, options={
    "max_peers": 64,         # peers exported per run, the furthest above their best first
    "queues_every": 60.0,    # seconds between reads of addresses and egress queues
})
class LinksCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self.retransmits = link_view.Retransmits()
        self.fds = SocketFds()
        # netns -> (when read, its addresses and queues, whether a peer was slow then)
        self._queues: dict[str, tuple[float, dict[str, Any], bool]] = {}

    def collect(self) -> Result:
        ranks = running_ranks(self.ctx.store.data("ranks"))
        if not ranks:
            return Result.absent("no running rank process on this node")
        result = Result()
        unseen: dict[str, int] = {}
        reasons: list[str] = []
        by_netns: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for run, r in ranks:
            unseen.setdefault(run, 0)
            ns = netns_id(r["pid"])
            if ns is None:
                unseen[run] += 1
                reasons.append(f"rank {r['rank']} of {run} (pid {r['pid']}): its network "
                               "namespace cannot be read")
            else:
                by_netns.setdefault(ns, []).append((run, r))
        jobs: dict[str, dict[str, Any]] = {}
        seen_retrans: list[tuple[str, str, dict[str, Any]]] = []
        for ns, members in by_netns.items():
            self._namespace(ns, members, jobs, unseen, reasons, seen_retrans)
        self.fds.forget_except({r["pid"] for _, r in ranks})
        self.retransmits.update(seen_retrans)
        self.retransmits.forget_except({(run, peer) for run, peer, _ in seen_retrans})
        self._export(result, jobs, unseen)
        result.data = {"jobs": jobs, "unseen_processes": unseen,
                       "unseen": reasons[:MAX_REASONS]}
        return result

    def _namespace(self, ns: str, members: list[tuple[str, dict[str, Any]]],
                   jobs: dict[str, dict[str, Any]], unseen: dict[str, int],
                   reasons: list[str], seen_retrans: list) -> None:
        """The ranks of one network namespace: one dump, each rank's sockets in it."""
        pid = members[0][1]["pid"]
        held: dict[int, tuple[str, dict[str, Any], set[int]]] = {}  # pid -> run, rank, inodes
        for run, r in members:
            inodes = self.fds.inodes(r["pid"])
            if inodes is None:
                unseen[run] += 1
                reasons.append(f"rank {r['rank']} of {run} (pid {r['pid']}): its open "
                               "files cannot be read")
            else:
                held[r["pid"]] = (run, r, inodes)
        if not held:
            return
        wanted = set().union(*(inodes for _, _, inodes in held.values()))
        try:  # only the ranks' sockets are parsed: a node may hold thousands of others
            sockets = call_in_netns(pid, lambda: tcp_sockets(only=wanted))
        except OSError as exc:
            for run, _, _ in held.values():
                unseen[run] += 1
            reasons.append(f"the TCP connections of {ns}: {exc}")
            return
        by_inode = {s["inode"]: s for s in sockets}
        # The node's own addresses: those its sockets use, and its interfaces' once read.
        local = {str(s.get("src")) for s in sockets} | set(
            (self._queues.get(ns, (0.0, {}, False))[1].get("addresses") or {}))
        owned: dict[tuple[str, str], list[link_view.Owned]] = {}
        for run, r, inodes in held.values():
            node = str(r.get("node") or self.ctx.node)
            owned.setdefault((run, node), []).extend(
                (r["rank"], by_inode[i]) for i in inodes if i in by_inode)
        for (run, node), conns in owned.items():
            peers = link_view.peers(conns, local)
            seen_retrans.extend((run, str(s.get("dst")), s) for _, s in conns
                                if not link_view.is_local(str(s.get("dst")), local))
            queues = self._links(ns, pid, any(map(link_view.suspect, peers.values())), local)
            job = jobs.setdefault(run, {"nodes": {}, "peers": {}})
            job["peers"].update(peers)
            job["nodes"][node] = {"netns": ns, "ranks": sorted({rank for rank, _ in conns}),
                                  **queues, "sockets": link_view.address_pairs(conns)}

    def _links(self, ns: str, pid: int, slow: bool, local: set[str]) -> dict[str, Any]:
        """The namespace's addresses and egress queues, read again when old or a peer is
        slow; without ``ip``/``tc`` (or leave to run them), the addresses the sockets use."""
        mono = time.monotonic()
        held = self._queues.get(ns)
        every = float(self.options["queues_every"])
        # A peer turning slow has them read at once, then at most once a second.
        if held is None or mono - held[0] >= every or (
                slow and (not held[2] or mono - held[0] >= 1.0)):
            try:
                links = node_links(pid)
            except (OSError, ValueError) as exc:  # no iproute2, refused, odd JSON
                links = {"addresses": {a: "" for a in sorted(local)}, "qdiscs": {},
                         "queues_error": str(exc)[:200]}
            held = (mono, links, slow)
            self._queues[ns] = held
        return held[1]

    def _export(self, result: Result, jobs: dict[str, dict[str, Any]],
                unseen: dict[str, int]) -> None:
        node = self.ctx.node
        keep = int(self.options["max_peers"])
        for run, count in unseen.items():
            result.add("trainwatch_link_unseen_processes", count, node=node, run=run)
        for run, job in jobs.items():
            shown = link_view.worst(job["peers"], keep)
            job["peers_not_exported"] = len(job["peers"]) - len(shown)
            for peer, entry in shown.items():
                lab = {"node": node, "run": run, "peer": peer}
                rtt, best = entry["rtt_ms"], entry["min_rtt_ms"]
                result.add("trainwatch_link_rtt_seconds",
                           None if rtt is None else rtt / 1000, **lab)
                result.add("trainwatch_link_min_rtt_seconds",
                           None if best is None else best / 1000, **lab)
                result.add("trainwatch_link_connections", entry["connections"], **lab)
                result.add("trainwatch_link_retransmits_total",
                           self.retransmits.totals.get((run, peer), 0.0), **lab)
