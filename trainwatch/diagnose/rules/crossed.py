"""Rule: ranks waiting crossed in two groups' collectives (one side skipped a collective)."""

from __future__ import annotations

from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Finding
from trainwatch.diagnose.stacks import format_frames


def check_crossed(a: Analysis) -> list[Finding]:
    """Ranks waiting in different groups' collectives for each other: one side skipped a
    collective (or issued an extra one). The smaller side is named; equal sides are a tie."""
    if not a.stalled:
        return []
    findings = []
    for c in a.crossed:
        culprits, waiting, other = c["culprits"], c["waiting"], c["waits_in"]
        if set(culprits + waiting) & a.explained:
            continue
        a.explained |= set(culprits + waiting)
        names = f"rank(s) {culprits}"
        evidence = [
            f"process group {c['group']}: rank(s) {waiting} wait in collective #{c['seq']} "
            f"{c['op']}; {names} never entered it (their last there: "
            f"#{a.groups[c['group']]['behind'][culprits[0]]['last_enqueued']}, completed)",
            f"process group {other['group']}: {names} wait in collective #{other['seq']} "
            f"{other['op']}, which rank(s) {waiting} never entered",
            "each side waits for the other: one skipped a collective the other issued "
            "(or issued an extra one)"]
        if c["tie"]:
            title = (f"collective desync: ranks {culprits} and {waiting} wait in different "
                     f"collectives (#{c['seq']} of process group {c['group']}, "
                     f"#{other['seq']} of process group {other['group']}); which side "
                     "skipped one cannot be told")
            evidence.append("the two sides are the same size: no odd one out")
            culprits, confidence = sorted(culprits + waiting), "low"
        else:
            title = (f"collective desync: {names} did not enter collective #{c['seq']} "
                     f"({c['op']}) of process group {c['group']}, which rank(s) {waiting} "
                     "wait in")
            evidence.append(f"{names} are the odd one out ({len(culprits)} against "
                            f"{len(waiting)})")
            confidence = "high"
        findings.append(Finding(
            "collective_desync", title, ranks=culprits, confidence=confidence,
            nodes=sorted({a.node(r) for r in culprits if r in a.ev.ranks}),
            evidence=[a.where_line(r) for r in culprits if r in a.ev.ranks] + evidence,
            runbook="TrainingStalled",
            next_command="check the code between the two collectives: every rank must issue "
                         "the same collectives on every group in the same order (look for "
                         "rank-dependent branches)",
            stack=format_frames(a.stack(culprits[0]))))
    return findings
