"""A node's interfaces as the kernel shapes them: each interface's addresses and its root
egress queue discipline with its counters (``ip -j addr``, ``tc -s -j qdisc``: iproute2's
JSON), read in a process's network namespace.

A shaping qdisc (a token bucket, HTB, netem, cake) that holds packets back
(``overlimits``, ``backlog``, ``drops``) is evidence of which end of a slow link is slow:
both ends of a link see the same round-trip time, only the slowed end queues.
"""

from __future__ import annotations

import json
from typing import Any

from trainwatch.host.netns_call import command_in_netns

SHAPING = ("tbf", "htb", "netem", "cake", "hfsc", "cbq", "cbs", "taprio")


def parse_addresses(text: str) -> dict[str, str]:
    """``ip -j addr show``: address -> interface name."""
    out = {}
    for link in json.loads(text or "[]"):
        for info in link.get("addr_info") or []:
            if info.get("local") and link.get("ifname"):
                out[str(info["local"])] = str(link["ifname"])
    return out


def parse_qdiscs(text: str) -> dict[str, dict[str, Any]]:
    """``tc -s -j qdisc show``: interface -> its root qdisc (kind, rate or delay when it
    says, packets sent, overlimits, drops, backlog bytes, and whether it shapes)."""
    out: dict[str, dict[str, Any]] = {}
    for q in json.loads(text or "[]"):
        if not q.get("root") or not q.get("dev"):
            continue
        options = q.get("options") or {}
        delay = options.get("delay")
        out[str(q["dev"])] = {
            "kind": q.get("kind"), "shaping": q.get("kind") in SHAPING,
            "rate": options.get("rate"),
            "delay": delay.get("delay") if isinstance(delay, dict) else delay,
            "packets": q.get("packets"), "overlimits": q.get("overlimits"),
            "drops": q.get("drops"), "backlog": q.get("backlog")}
    return out


def node_links(pid: int) -> dict[str, Any]:
    """The addresses and root qdiscs of the network namespace ``pid`` is in."""
    return {"addresses": parse_addresses(command_in_netns(pid, ["ip", "-j", "addr", "show"])),
            "qdiscs": parse_qdiscs(command_in_netns(pid, ["tc", "-s", "-j", "qdisc", "show"]))}
