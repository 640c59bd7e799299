"""The /status document (format ``trainwatch.agent.status``, see docs/agent.md).

Built from the last collected values only.  Rank environments are never shown
(they may hold secrets); only names of variables that differ across ranks are.
"""

from __future__ import annotations

import os
import time
from typing import Any

from trainwatch import __version__
from trainwatch.agent.collectors.journal import REPLACED_SHOWN_SECONDS
from trainwatch.agent.context import AgentContext

STATUS_FORMAT = "trainwatch.agent.status"
STATUS_VERSION = 1
_RANK_FIELDS = ("rank", "local_rank", "pid", "node", "state", "step", "phase", "restart_count",
                "backend", "device")


def _age(observed: Any, elapsed: float) -> float | None:
    """An age the ranks collector observed, carried forward to now."""
    return round(observed + elapsed, 3) if isinstance(observed, (int, float)) else None


def build_status(ctx: AgentContext, *, listen: str, config_loaded_at: float) -> dict[str, Any]:
    now = time.time()
    records = ctx.store.snapshot()
    ranks_data = (records["ranks"].data if "ranks" in records else None) or {"jobs": []}
    findings = (records["findings"].data if "findings" in records else None) or {}
    verdicts = findings.get("ranks", {})
    gpu = (records["gpu"].data if "gpu" in records else None) or {}
    nccl = (records["nccl"].data if "nccl" in records else None) or {}
    journals = (records["journal"].data if "journal" in records else None) or {}
    replicas = (records["replicas"].data if "replicas" in records else None) or {}
    gpus_by_pid: dict[int, list[dict[str, Any]]] = {}
    for g in gpu.get("gpus", []):
        for proc in g.get("processes", []):
            gpus_by_pid.setdefault(proc["pid"], []).append(
                {"gpu": g["index"], "uuid": g["uuid"], "memory_bytes": proc.get("memory_bytes")})

    observed = ranks_data.get("observed_mono")
    elapsed = max(0.0, time.monotonic() - observed) if isinstance(observed, float) else 0.0
    jobs = []
    for job in ranks_data["jobs"]:
        ranks = []
        for r in job["ranks"]:
            verdict = verdicts.get(f"{job['job']}/{r['rank']}", {})
            metrics = r.get("metrics") or {}
            entry = {k: r.get(k) for k in _RANK_FIELDS}
            entry.update({
                "health": _rank_health(r, verdict),
                "process": {k: v for k, v in (r.get("process") or {}).items()},
                "phase_age_seconds": _age(r.get("phase_age"), elapsed),
                "heartbeat_age_seconds": _age(r.get("heartbeat_age"), elapsed),
                "progress_age_seconds": _age(r.get("progress_age"), elapsed),
                "publish": r.get("publish"),
                "loss": metrics.get("loss"), "step_time_seconds": metrics.get("step_time_seconds"),
                "typical_step_seconds": verdict.get("typical_step_seconds"),
                "tokens_per_second": metrics.get("tokens_per_second"),
                "samples_per_second": metrics.get("samples_per_second"),
                "stall": verdict.get("stall"), "straggler": verdict.get("straggler"),
                "gpus": gpus_by_pid.get(r.get("pid"), []),
            })
            ranks.append(entry)
        jobs.append({
            "job": job["job"], "run_dir": job["run_dir"], "backend": job.get("backend"),
            "world_size": job.get("world_size"),
            "status_files_skipped_total": job.get("status_files_skipped_total", 0),
            "skipped": job.get("skipped", []),
            "unreadable": job.get("unreadable", []),
            "journal": journals.get(job["run_dir"]),
            "nccl": (nccl.get("jobs") or {}).get(job["job"], {}).get("ras"),
            "node_straggler": (findings.get("node_stragglers") or {}).get(job["job"]),
            "replica_groups": (replicas.get("jobs") or {}).get(job["job"], {}),
            "ranks": ranks})

    active = findings.get("findings", [])
    collectors = {name: rec.summary() for name, rec in sorted(records.items())}
    supervisors = (records["supervisor"].data if "supervisor" in records else None) or {}
    health, reasons = _node_health(active, collectors, ranks_data["jobs"], supervisors)
    reasons += _journal_reasons(journals, now)
    if reasons and health == "ok":
        health = "degraded"
    node_health = {name: records[name].data for name in ("gpu", "storage", "network", "nccl")
                   if name in records and records[name].data is not None}
    return {
        "format": STATUS_FORMAT, "version": STATUS_VERSION, "node": ctx.node, "time": now,
        "health": health, "health_reasons": reasons,
        "agent": {"version": __version__, "pid": os.getpid(), "started_at": ctx.started_at,
                  "listen": listen, "config_file": ctx.config.file,
                  "config_loaded_at": config_loaded_at,
                  "run_dirs": [job["run_dir"] for job in ranks_data["jobs"]]},
        "versions": (records["versions"].data if "versions" in records else None) or {},
        "jobs": jobs, "findings": active,
        "recently_cleared": findings.get("recently_cleared", []),
        "collectors": collectors, "node_health": node_health,
        # Each watched run's supervisor as this host judges it (TrainwatchSupervisorDown).
        "supervisors": supervisors,
        # The ranks' links per peer, with the node's addresses and egress queues (the links
        # collector): the other end of a slow link for diagnose --agent.
        "links": (records["links"].data if "links" in records else None) or {},
    }


def _rank_health(rank: dict[str, Any], verdict: dict[str, Any]) -> str:
    if rank.get("state") != "running":
        return str(rank.get("state"))
    if (verdict.get("stall") or {}).get("stalled"):
        return "stalled"
    if (verdict.get("straggler") or {}).get("active"):
        return "straggler"
    if not verdict:
        return "unknown"
    return "ok"


def _journal_reasons(journals: dict[str, Any], now: float) -> list[str]:
    """A journal the agent may not read, or found replaced while the run goes on (the
    journal collector, TrainwatchJournalUnreliable): the run's record is not whole."""
    reasons = []
    for j in journals.values():
        if not isinstance(j, dict):
            continue
        if j.get("error"):
            reasons.append(f"job {j['job']}: its journal {j['path']} cannot be read "
                           f"({j['error']}): what it says (alerts, restarts, the supervisor's "
                           "stop) is unseen (runbook TrainwatchJournalUnreliable)")
        at = j.get("replaced_at")
        if isinstance(at, (int, float)) and now - at < REPLACED_SHOWN_SECONDS:
            reasons.append(f"job {j['job']}: its journal {j['path']} was replaced, truncated "
                           f"or removed while the run goes on ({j['replaced_total']} time(s), "
                           f"last {now - at:.0f} s ago): what it said before is lost to "
                           "report and diagnose (runbook TrainwatchJournalUnreliable)")
    return reasons


def _node_health(findings: list[dict[str, Any]], collectors: dict[str, dict[str, Any]],
                 jobs: list[dict[str, Any]], supervisors: dict[str, dict[str, Any]]):
    reasons = [f"job {f['job']}: {f['message']}" for f in findings]
    # A supervisor down is critical: its job runs with no repair and its engine is silent.
    down = [s for s in supervisors.values() if not s.get("up")]
    reasons += [f"job {s['job']}: its supervisor ({s['holder']}) is {s['state']}: nothing "
                "repairs the job and its own alerts do not fire (runbook "
                "TrainwatchSupervisorDown)" for s in down]
    for job in jobs:
        if job.get("unreadable"):
            reasons.append(f"job {job['job']}: permission denied reading "
                           f"{', '.join(job['unreadable'][:3])}"
                           f"{' and more' if len(job['unreadable']) > 3 else ''}: its ranks "
                           "there are unseen (docs/run-directory.md: Permissions)")
    for name, c in collectors.items():
        if c["state"] in ("failed", "timeout"):
            reasons.append(f"collector {name} {c['state']}: {c['reason']}")
    if down or any(f["severity"] == "critical" for f in findings):
        return "critical", reasons
    return ("degraded" if reasons else "ok"), reasons
