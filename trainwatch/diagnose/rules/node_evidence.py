"""Rule: node problems the agents report (GPU, storage, network), and alerts still firing."""

from __future__ import annotations

import re
from typing import Any

from trainwatch.diagnose import agents, prometheus
from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Finding

_AGENT_KINDS = (  # agent finding kind / node evidence -> (category, runbook)
    (re.compile(r"xid|ecc|gpu", re.I), "gpu_fault", "GPUXidErrors"),
    (re.compile(r"storage|disk|probe", re.I), "storage", "StorageProbeSlow"),
    (re.compile(r"nccl", re.I), "network", "NCCLErrors"),
    (re.compile(r"network|nic|infiniband|\bib\b|link", re.I), "network",
     "NetworkInterfaceErrors"),
    (re.compile(r"straggler", re.I), "straggler", "TrainingStragglerRank"),
)


def check_node_evidence(a: Analysis) -> list[Finding]:
    """Node problems the agents report, attached to the ranks on those nodes."""
    findings: list[Finding] = []
    for f in agents.node_findings(a.ev):
        kind = str(f.get("kind", ""))
        if kind == "stall":
            continue  # diagnose explains stalls itself; the agent's view is in the evidence
        for pattern, category, runbook in _AGENT_KINDS:
            if pattern.search(kind):
                if category == "straggler" and any(x.category == "straggler" for x in findings):
                    break
                rank = f.get("rank")
                findings.append(Finding(
                    category, f"node {f.get('node')}: {f.get('message') or kind}",
                    severity="critical" if f.get("severity") == "critical" else "warning",
                    confidence="medium", ranks=[rank] if isinstance(rank, int) else [],
                    nodes=[str(f.get("node"))],
                    evidence=[f"agent finding {f.get('id')}"] + list(f.get("evidence") or []),
                    runbook=runbook, next_command=f"curl -s {_agent_url(a, f)}/status"))
                break
    for agent in a.ev.agents:
        for store in ((agent.get("node_health") or {}).get("storage") or []):
            probe = store.get("probe") or {}
            if probe and not probe.get("ok", True):
                findings.append(Finding(
                    "storage", f"node {agent.get('node')}: storage probe failed on "
                    f"{store.get('path')}", confidence="high", nodes=[str(agent.get("node"))],
                    evidence=[f"probe error: {probe.get('error')} after {probe.get('seconds')} s"],
                    runbook="StorageProbeSlow", next_command=f"df -h {store.get('path')}"))
    alerts = sorted({str(r.get("alert") or r.get("alertname"))
                     for r in a.ev.journal.get("firing_alerts", [])}
                    | set(prometheus.firing_alerts(a.ev)))
    if alerts:
        findings.append(Finding("alerts", "alerts firing: " + ", ".join(alerts), severity="info",
                                confidence="medium", evidence=["from the journal and Prometheus"]))
    return findings


def _agent_url(a: Analysis, finding: dict[str, Any]) -> str:
    return next((x["url"] for x in a.ev.agents if x.get("node") == finding.get("node")),
                "AGENT_URL")
