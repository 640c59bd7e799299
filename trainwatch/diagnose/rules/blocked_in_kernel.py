"""Rule: a stall nothing stronger explained, where a rank's kernel wait tells why."""

from __future__ import annotations

from trainwatch.diagnose import causes
from trainwatch.diagnose.casefile import Analysis, cause_lines
from trainwatch.diagnose.model import Finding
from trainwatch.diagnose.stacks import format_frames


def check_blocked_in_kernel(a: Analysis) -> list[Finding]:
    """A stall no collective analysis explained, where a rank's kernel wait tells why."""
    if not a.stalled or a.explained & set(a.running):
        return []
    findings = []
    for rank in sorted(a.running):
        cause = causes.rank_cause(a.ev.ranks[rank], a.ev.stacks.get(rank))
        if cause is None or cause["kind"] == "lock":
            continue
        a.explained.add(rank)
        stack = a.stack(rank)
        others = [r for r in sorted(a.running) if r != rank]
        findings.append(Finding(
            "rank_stuck", f"rank {rank} is blocked: {causes.describe(cause)}", ranks=[rank],
            nodes=[a.node(rank)], confidence="medium",
            evidence=[a.where_line(rank), *cause_lines(cause, stack)]
            + ([f"rank(s) {others} made no progress either (waiting for it?)"] if others else []),
            runbook="TrainingStalled",
            next_command=f"py-spy dump --pid {a.ev.ranks[rank].get('pid')} --native",
            stack=format_frames(stack), cause=cause))
    return findings
