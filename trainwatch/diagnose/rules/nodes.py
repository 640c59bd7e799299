"""Rule: what happened to the job's nodes — a node's launcher that exited, a rendezvous
that waits for nodes, a node that stopped reporting — and its attempts across nodes.

A job on several nodes fails as a job: one node's launcher gives up while another's,
started again, waits in the rendezvous for a node that never comes. Each node's events are
in the one journal (``diagnose/launchers.py``) and each rank's status in the shared run
directory, so diagnose on any node says it for every node. A node stopped reporting when
none of its ranks wrote a status within ``heartbeat_stale_seconds`` and not all of them
finished or stopped cleanly. Says facts, names no culprit rank (``first_silent`` does).
"""

from __future__ import annotations

from typing import Any

from trainwatch.contract.layout import JOURNAL_FILE
from trainwatch.diagnose.casefile import Analysis, duration
from trainwatch.diagnose.model import Finding
from trainwatch.rundir import attempts

RENDEZVOUS_GRACE_SECONDS = 10.0  # a launcher's workers start within seconds of its start
_ENDED = ("finished", "stopped")


def check_nodes(a: Analysis) -> list[Finding]:
    ev = a.ev
    facts = ev.journal.get("launchers") or {}
    hosts: list[dict[str, Any]] = facts.get("hosts") or []
    nnodes = max((n for n in ((ev.run or {}).get("nnodes"), facts.get("nnodes"))
                  if isinstance(n, int) and not isinstance(n, bool)), default=1)
    nodes = sorted({str(v.get("node") or "?") for v in ev.ranks.values()}
                   | {h["host"] for h in hosts})
    if max(nnodes, len(nodes)) < 2:
        return []
    now = ev.collected_at
    silent = _silent(a)
    by_host = {h["host"]: h for h in hosts}
    running = [h for h in hosts if h["exited_at"] is None]
    waiting = [h for h in running if h["ranks_started_at"] is None
               and now - h["started_at"] > RENDEZVOUS_GRACE_SECONDS]
    missing = nnodes - len(running)
    # Every node silent and no launcher event to tell them apart: the job ended as a
    # whole (the rules on its ranks say how), not a node.
    if set(silent) >= {str(v.get("node") or "?") for v in ev.ranks.values()}:
        silent = {n: v for n, v in silent.items() if n in by_host
                  and (by_host[n]["exited_at"] is not None or by_host[n] in waiting)}
    findings = []
    for node in nodes:
        launcher = by_host.get(node)
        lines = []
        if launcher in waiting and missing > 0:
            lines.append(f"{node}'s launcher (pid {launcher['pid']}) started "
                         f"{duration(now - launcher['started_at'])} ago and no rank started "
                         f"under it since: the rendezvous waits for {missing} more node(s) "
                         f"of {nnodes} (launchers running: "
                         f"{[h['host'] for h in running]})")
        if node in silent:
            ranks, age = silent[node]
            lines.append(f"node {node} stopped reporting: no fresh status from any of its "
                         f"ranks {ranks} for {duration(age)}")
        if launcher is not None and launcher["exited_at"] is not None \
                and (launcher["exit_code"] or node in silent):
            lines.append(f"{node}'s launcher exited ({_exit(launcher)}) "
                         f"{duration(now - launcher['exited_at'])} ago and none started since")
        if lines:
            findings.append(_finding(a, node, lines, stuck=missing > 0 or bool(silent)))
    if findings:
        findings[0].evidence.append(_attempts_line(ev, facts))
    return findings


def _silent(a: Analysis) -> dict[str, tuple[list[int], float]]:
    """node -> (its ranks, the age of its newest heartbeat) for nodes none of whose ranks
    reports, and not all of which ended cleanly."""
    stale = float(a.stall_options["heartbeat_stale_seconds"])
    by_node: dict[str, list[int]] = {}
    for rank, view in a.ev.ranks.items():
        by_node.setdefault(str(view.get("node") or "?"), []).append(rank)
    out = {}
    for node, ranks in by_node.items():
        views = [a.ev.ranks[r] for r in ranks]
        if all(v.get("state") in _ENDED for v in views):
            continue
        ages = [v.get("heartbeat_age") for v in views if v.get("state") not in _ENDED]
        known = [x for x in ages if isinstance(x, (int, float))]
        if known and min(known) > stale and len(known) == len(ages):
            out[node] = (sorted(ranks), float(min(known)))
    return out


def _exit(launcher: dict[str, Any]) -> str:
    if launcher.get("signal"):
        return f"on {launcher['signal']}"
    return f"exit code {launcher.get('exit_code')}"


def _attempts_line(ev: Any, facts: dict[str, Any]) -> str:
    """Attempts counted across nodes (one restart of the job on all its nodes is one), and a
    newer start under which no rank started yet."""
    line = f"journal: {attempts.describe(ev.journal.get('restarts') or attempts.summary([]))}"
    job = facts.get("job_started")
    started = [a["started_at"] for a in ev.journal.get("attempts") or []]
    if job and job.get("attempt") and (not started or job["time"] > max(started)):
        line += (f"; attempt {job['attempt']} began on {job['host']} "
                 f"{duration(ev.collected_at - job['time'])} ago and no rank has started in it")
    return line + " (counted across nodes: one restart of the job on every node is one attempt)"


def _finding(a: Analysis, node: str, lines: list[str], stuck: bool) -> Finding:
    ranks = sorted(r for r, v in a.ev.ranks.items() if str(v.get("node") or "?") == node)
    return Finding("node", lines[0][0].upper() + lines[0][1:],
                   severity="critical" if stuck else "warning", nodes=[node],
                   evidence=lines[1:] + [a.where_line(r) for r in ranks[:4]],
                   runbook="TrainingRanksMissing",
                   next_command=f"grep -E '\"event\":\"(launcher_started|launcher_exited|"
                                f"job_started)\"' {a.ev.run_dir}/{JOURNAL_FILE} | tail")
