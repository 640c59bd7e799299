"""Node health from ``trainwatch agent`` /status documents (docs/agent.md)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainwatch.diagnose.http_json import get_json
from trainwatch.diagnose.model import Evidence

AGENT_FORMAT = "trainwatch.agent.status"
MAX_PARALLEL = 16


def gather(ev: Evidence, urls: list[str], timeout: float) -> None:
    if not urls:
        ev.cannot_see("node health (no --agent URL given): GPU, NIC and storage evidence")
        return
    job = (ev.run or {}).get("job") or next(
        (v.get("job") for v in ev.ranks.values() if v.get("job")), None)
    # Concurrently: 128 nodes' agents cost one timeout at worst, not 128.
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(urls))) as pool:
        ev.agents.extend(pool.map(lambda url: fetch(url, timeout), urls))
    for agent in ev.agents:
        if agent.get("error"):
            ev.cannot_see(f"agent {agent['url']}: {agent['error']}")
            continue
        for collector, info in (agent.get("collectors") or {}).items():
            if isinstance(info, dict) and info.get("state") in ("failed", "timeout"):
                ev.cannot_see(f"agent {agent.get('node')}: collector {collector} "
                              f"{info['state']} ({info.get('reason')})")
        fill_remote_processes(ev, agent, job)


def fetch(url: str, timeout: float) -> dict[str, Any]:
    status_url = url.rstrip("/")
    if not status_url.endswith("/status"):
        status_url += "/status"
    try:
        doc = get_json(status_url, timeout)
    except (OSError, ValueError) as exc:
        return {"url": url, "error": f"unreachable ({exc})"}
    if not isinstance(doc, dict) or doc.get("format") != AGENT_FORMAT:
        return {"url": url, "error": f"not a {AGENT_FORMAT} document"}
    if not isinstance(doc.get("version"), int) or doc["version"] > 1:
        return {"url": url, "error": f"agent status version {doc.get('version')!r} not supported"}
    keep = ("node", "time", "health", "health_reasons", "findings", "collectors",
            "node_health", "jobs", "versions", "links")
    return {"url": url, **{k: doc.get(k) for k in keep}}


def fill_remote_processes(ev: Evidence, agent: dict[str, Any], job: str | None) -> None:
    """Process state of ranks on the agent's node, where this host cannot see them."""
    for entry in agent.get("jobs") or []:
        if job and entry.get("job") != job:
            continue
        for rank_info in entry.get("ranks") or []:
            view = ev.ranks.get(rank_info.get("rank"))
            process = rank_info.get("process") or {}
            if view is not None and not (view.get("process") or {}).get("visible"):
                view["process"] = {"status": process.get("status", "unknown"),
                                   "visible": True, "via": f"agent {agent.get('node')}"}


def node_findings(ev: Evidence) -> list[dict[str, Any]]:
    """The agents' current findings, each tagged with its node."""
    found = []
    for agent in ev.agents:
        for finding in agent.get("findings") or []:
            if isinstance(finding, dict):
                found.append({"node": agent.get("node"), **finding})
    return found
