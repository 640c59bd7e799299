"""A node's links as its rank processes use them: the kernel's per-socket TCP view
(trainwatch/host/tcp_diag.py) folded into one entry per address pair and one per peer
address, never per socket.

gloo opens a connection from every rank to every other rank (and more per process group),
so per-socket series would grow with the job; per peer they grow with the nodes a node
talks to, and the agent exports at most ``max_peers`` of them. The RTT of a peer is the
median of its recently active connections' (an idle connection's RTT is old news); its best
is the smallest ``min_rtt`` (the kernel's windowed minimum: how fast the link was).
Retransmissions are summed into a counter per peer from each connection's growth, so a
connection that closes never makes the counter go down.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from trainwatch.host.tcp_diag import recently_active

LOOPBACK = ("127.", "::1")
SUSPECT_MS = 5.0      # a peer this slow, and SUSPECT_RATIO x its best, has the queues re-read
SUSPECT_RATIO = 5.0

Owned = tuple[int, dict[str, Any]]  # (rank, socket from tcp_diag.tcp_sockets)


def is_local(dst: str, local_addresses: set[str]) -> bool:
    """A connection within the node (loopback or one of its own addresses)."""
    return dst in local_addresses or dst.startswith(LOOPBACK)


def _fold(owned: list[Owned]) -> dict[str, Any]:
    socks = [s for _, s in owned]
    active = [s["rtt_ms"] for s in socks if recently_active(s)]
    best = [s["min_rtt_ms"] for s in socks if isinstance(s.get("min_rtt_ms"), (int, float))]
    ages = {k: [s[k] for s in socks if isinstance(s.get(k), int)]
            for k in ("last_data_sent", "last_data_recv")}
    return {"ranks": sorted({rank for rank, _ in owned}), "connections": len(socks),
            "active": len(active),
            "rtt_ms": round(statistics.median(active), 3) if active else None,
            "min_rtt_ms": min(best) if best else None,
            "total_retrans": sum(s.get("total_retrans") or 0 for s in socks),
            **{k: min(v) if v else None for k, v in ages.items()}}


def address_pairs(owned: list[Owned]) -> list[dict[str, Any]]:
    """One entry per (local address, peer address): the shape of diagnose's per-socket
    entries (``src``, ``dst``, ``rtt_ms``, ``min_rtt_ms``, ``total_retrans``, last data
    ages), with ``ranks``, ``connections`` and ``active`` instead of one ``rank``."""
    groups: dict[tuple[str, str], list[Owned]] = {}
    for rank, s in owned:
        groups.setdefault((str(s.get("src")), str(s.get("dst"))), []).append((rank, s))
    return [{"src": src, "dst": dst, **_fold(each)} for (src, dst), each in sorted(groups.items())]


def peers(owned: list[Owned], local_addresses: set[str]) -> dict[str, dict[str, Any]]:
    """Peer address -> its folded entry, connections within the node left out."""
    groups: dict[str, list[Owned]] = {}
    for rank, s in owned:
        dst = str(s.get("dst"))
        if not is_local(dst, local_addresses):
            groups.setdefault(dst, []).append((rank, s))
    return {dst: _fold(each) for dst, each in sorted(groups.items())}


def suspect(entry: dict[str, Any]) -> bool:
    """A peer slow enough, against its own best, that which end queues is worth knowing."""
    rtt, best = entry.get("rtt_ms"), entry.get("min_rtt_ms")
    return isinstance(rtt, (int, float)) and rtt >= SUSPECT_MS and (
        not isinstance(best, (int, float)) or rtt >= SUSPECT_RATIO * max(best, 0.001))


def worst(found: dict[str, dict[str, Any]], keep: int) -> dict[str, dict[str, Any]]:
    """At most ``keep`` peers: those furthest above their own best RTT (then slowest)."""
    if len(found) <= keep:
        return found

    def how_slow(item: tuple[str, dict[str, Any]]) -> tuple[float, float]:
        rtt, best = item[1].get("rtt_ms") or 0.0, item[1].get("min_rtt_ms") or 0.0
        return (rtt / max(best, 0.001), rtt)
    return dict(sorted(found.items(), key=how_slow, reverse=True)[:keep])


class Retransmits:
    """Retransmissions per (run, peer) as counters: each connection's ``total_retrans``
    growth since it was last seen (all of it for a connection seen the first time)."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}          # socket inode -> its total_retrans
        self.totals: dict[tuple[str, str], float] = {}

    def update(self, seen: Iterable[tuple[str, str, dict[str, Any]]]) -> None:
        """``seen``: (run, peer, socket) of every connection to a peer, this run."""
        now: dict[int, int] = {}
        for run, peer, s in seen:
            total = s.get("total_retrans")
            if not isinstance(total, int):
                continue
            grew = total - self._last.get(s["inode"], 0)
            now[s["inode"]] = total
            key = (run, peer)
            self.totals[key] = self.totals.get(key, 0.0) + max(grew, 0)
        self._last = now

    def forget_except(self, keys: set[tuple[str, str]]) -> None:
        """Peers no rank is connected to any more: their counters go with them."""
        for key in set(self.totals) - keys:
            del self.totals[key]
