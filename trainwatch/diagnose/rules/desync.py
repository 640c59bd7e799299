"""Rule: ranks issued different collectives at the same sequence number of a process group."""

from __future__ import annotations

from trainwatch.diagnose.casefile import IN_COLLECTIVE, Analysis
from trainwatch.diagnose.model import Finding
from trainwatch.diagnose.stacks import format_frames


def check_desync(a: Analysis) -> list[Finding]:
    findings = []
    for pg, g in a.groups.items():
        mismatch = g.get("mismatch")
        if not mismatch:
            continue
        ranks = sorted(mismatch["ops"])
        evidence = [f"process group {pg} ({g['desc']}), collective #{mismatch['seq']}:"]
        evidence += [f"  rank {r}: {op}" for r, op in mismatch["ops"].items()]
        for r, frames in mismatch["frames"].items():
            site = next((f for f in frames if not IN_COLLECTIVE.search(str(f.get("file")))),
                        frames[0] if frames else None)
            if site:
                evidence.append(f"  rank {r} issued it at {site.get('file')}:{site.get('line')} "
                                f"in {site.get('function')}")
        if g["frontier"] == mismatch["seq"]:
            evidence.append(f"ranks {g['waiting']} are all waiting in #{g['frontier']}: "
                            "they will never match")
        a.explained |= set(ranks)
        # The odd one out: a rank issuing an op it never issued before (the extra
        # collective), else the minority op; with no way to tell, all of them.
        counts = {op: list(mismatch["ops"].values()).count(op) for op in mismatch["ops"].values()}
        minority = [r for r, op in mismatch["ops"].items() if counts[op] < max(counts.values())]
        culprits = next((c for c in (mismatch["novel"], minority) if 0 < len(c) < len(ranks)),
                        ranks)
        if culprits != ranks:
            evidence.append(f"rank(s) {culprits} issued an op they had not issued before "
                            "(the extra or missing collective is theirs)"
                            if culprits == mismatch["novel"] else
                            f"rank(s) {culprits} differ from the majority")
        findings.append(Finding(
            "collective_desync",
            f"collective desync at sequence number {mismatch['seq']} in process group {pg}: "
            "ranks issued different collectives", ranks=culprits,
            nodes=sorted({a.node(r) for r in culprits if r in a.ev.ranks}),
            evidence=evidence, runbook="TrainingStalled",
            next_command="check the call sites above: every rank must issue the same "
                         "collectives in the same order (look for rank-dependent branches)",
            stack=format_frames(a.stack(culprits[0]))))
    return findings
