"""Rule: the network link between two nodes is slow, and the job's collectives wait on it.

Evidence that does not share the failure (``Evidence.node_network``, diagnose/node_network.py):
the kernel's round-trip time of the ranks' own TCP connections. A link is slow when its
connections' RTT now is at least ``SLOW_MS``, ``RATIO`` times their best (``min_rtt``: the
same link before) and ``RATIO`` times the job's other connections (other links, the same
node; the fastest of them). Both ends of a link see the same RTT, so which node is slow comes from elsewhere:
the end whose egress queue shapes and holds packets back (a token bucket, netem), or, with
three nodes or more, the node every slow link has in common. Where neither says, the
finding names both ends: the slowness is between them (a switch, a cable).

Every running rank is then explained: the ranks slow together, none is a straggler in its
own compute, and none is stuck (a stalled job is left to the stall rules).
"""

from __future__ import annotations

import statistics
from typing import Any

from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Finding
from trainwatch.host.tcp_diag import recently_active

SLOW_MS = 5.0        # a link's RTT now, at least (datacenter links: tens of microseconds)
RATIO = 5.0          # ... and this many times its own best and the other connections'
SLOWED_RATIO = 1.3   # when the ranks' step history is known: the job slowed this much
LOOPBACK = ("127.", "::1")


def links(nodes: dict[str, Any]) -> tuple[dict[tuple[str, str], list[dict]], list[dict]]:
    """Active connections by link (node, peer node or address), and those within a node."""
    owner: dict[str, str | None] = {}
    for name, node in nodes.items():
        for addr in node.get("addresses") or {}:
            if not addr.startswith(LOOPBACK):
                owner[addr] = name if owner.get(addr, name) == name else None  # ambiguous
    by_link: dict[tuple[str, str], list[dict]] = {}
    local: list[dict] = []
    for name, node in nodes.items():
        mine = set(node.get("addresses") or {})
        for s in filter(recently_active, node.get("sockets") or []):
            dst = str(s.get("dst"))
            if dst in mine or dst.startswith(LOOPBACK):
                local.append(s)
                continue
            peer = owner.get(dst) or dst
            key = tuple(sorted((name, peer)))
            by_link.setdefault((key[0], key[1]), []).append({**s, "node": name})
    return by_link, local


def _shaped(nodes: dict[str, Any], name: str, conns: list[dict]) -> dict[str, Any] | None:
    """The shaping root qdisc holding packets back on ``name``'s interface of this link."""
    node = nodes.get(name) or {}
    for s in conns:
        if s["node"] != name:
            continue
        dev = (node.get("addresses") or {}).get(str(s.get("src")))
        q = (node.get("qdiscs") or {}).get(dev or "")
        if q and q.get("shaping") and any((q.get(k) or 0) > 0
                                          for k in ("overlimits", "backlog", "drops")):
            return {"dev": dev, **q}
    return None


def check_slow_link(a: Analysis) -> list[Finding]:
    net = a.ev.node_network or {}
    nodes = net.get("nodes") or {}
    if a.stalled or not nodes:
        return []
    by_link, local = links(nodes)
    rtts = {link: statistics.median(s["rtt_ms"] for s in c) for link, c in by_link.items()}
    if local:
        rtts[("", "")] = statistics.median(s["rtt_ms"] for s in local)  # within a node
    slow = {}
    for link, conns in by_link.items():
        rtt = rtts[link]
        best = min((s.get("min_rtt_ms") or rtt) for s in conns)
        # The fastest other link (or a node's own connections): what this one could be.
        other = min((v for k, v in rtts.items() if k != link), default=None)
        if rtt >= SLOW_MS and rtt >= RATIO * max(best, 0.001) and \
                (other is None or rtt >= RATIO * max(other, 0.001)):
            slow[link] = (conns, rtt, best, other)
    slowed = {r: s["ratio"] for r, s in (net.get("slowdown") or {}).items()
              if s and isinstance(s.get("ratio"), (int, float))}
    if not slow or (slowed and max(slowed.values()) < SLOWED_RATIO):
        return []
    common = set.intersection(*(set(link) for link in slow)) if len(slow) >= 2 else set()
    findings = []
    for (one, two), (conns, rtt, best, other) in sorted(slow.items(), key=lambda x: -x[1][1]):
        shaped = {n: q for n in (one, two) if (q := _shaped(nodes, n, conns))}
        culprit = (next(iter(shaped)) if len(shaped) == 1 else
                   next(iter(common)) if len(common) == 1 else None)
        ends = [culprit, two if culprit == one else one] if culprit else [one, two]
        findings.append(_finding(a, ends, culprit, conns, rtt, best, other, shaped, slowed))
    a.explained.update(a.running)
    return findings


def _finding(a: Analysis, ends: list[str], culprit: str | None, conns: list[dict],
             rtt: float, best: float, other: float | None, shaped: dict[str, Any],
             slowed: dict[int, float]) -> Finding:
    # A socket (this host's view) has one rank; an agent's entry folds its connections.
    ranks = sorted({r for s in conns for r in (s.get("ranks") or [s.get("rank")])})
    count = sum(s.get("connections") or 1 for s in conns)
    retrans = sum(s.get("total_retrans") or 0 for s in conns)
    others = f"others {other:.3g} ms" if other is not None else f"{best:.3f} ms at its best"
    evidence = [
        f"{count} TCP connection(s) of rank(s) {ranks} between {ends[0]} and {ends[1]}: "
        f"RTT {rtt:.1f} ms now (median), {best:.3f} ms at their best (the kernel's min_rtt), "
        f"{retrans} retransmission(s)",
        (f"the job's fastest other link: RTT {other:.3f} ms (median of its connections)"
         if other is not None else "the job has no other connection to compare with")]
    for name, q in shaped.items():
        rate, delay = q.get("rate"), q.get("delay")  # tc's JSON: bytes/s, seconds
        what = (f" rate {rate * 8 / 1000:g} kbit/s" if isinstance(rate, (int, float)) else "") \
            + (f" delay {delay * 1000:g} ms" if isinstance(delay, (int, float)) else "")
        evidence.append(f"node {name}: the egress queue of {q['dev']} shapes its traffic "
                        f"({q['kind']}{what}): {q.get('overlimits')} packet(s) held back "
                        f"(overlimits), {q.get('drops')} dropped, {q.get('backlog')} B queued")
    if culprit is None:
        evidence.append("neither end's egress queue shapes this link: the slowness is "
                        "between the nodes (a switch port, a cable, a negotiated-down link)")
    if slowed:
        evidence.append("the ranks' step time now vs earlier: " + ", ".join(
            f"rank {r} {x:.1f}x" for r, x in sorted(slowed.items())))
    evidence.append("every rank slows with the link: none is stuck or straggling in its "
                    "own compute")
    peer = next((s["dst"] for s in conns), "PEER")
    return Finding(
        "network", f"slow network link: node {ends[0]} ↔ node {ends[1]}, RTT {rtt:.1f} ms "
        f"({others})", severity="warning", confidence="high" if culprit else "medium",
        nodes=[culprit] if culprit else ends, evidence=evidence,
        runbook="TrainingNetworkLinkSlow", next_command=f"ss -tin dst {peer}; tc -s qdisc show")
