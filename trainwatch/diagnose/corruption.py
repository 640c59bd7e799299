"""Silent data corruption in what the ranks published: replicas whose parameter digests
disagree (the weights of one rank left the herd), and all-reduce checksums that did not
match (a reduction went wrong on its way to every replica). docs/sdc.md."""

from __future__ import annotations

from typing import Any

from trainwatch.contract.replicas import suspects_label, vote
from trainwatch.diagnose.model import Evidence, Finding

CONFIRMING_DIGESTS = 2  # as TrainingReplicaDivergence: the next digest confirms the first
SHOWN_STEPS = 3


def check(ev: Evidence) -> list[Finding]:
    return [*_divergence(ev), *_reduction(ev)]


def _divergence(ev: Evidence) -> list[Finding]:
    groups: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}  # group -> rank -> step -> d
    for rank, view in ev.ranks.items():
        for d in view.get("replicas") or []:
            groups.setdefault(d["group"], {}).setdefault(rank, {})[d["step"]] = d
    found = []
    for group, by_rank in sorted(groups.items()):
        if len(by_rank) < 2:
            continue
        common = sorted(set.intersection(*(set(steps) for steps in by_rank.values())))
        verdicts = [(step, *vote({r: steps[step] for r, steps in by_rank.items()}))
                    for step in common]
        if not verdicts or not verdicts[-1][1]:
            continue  # the newest step every rank digested agrees
        _, suspects, majority = verdicts[-1]
        streak = 0
        for _, s, m in reversed(verdicts):
            if (s, m) != (suspects, majority):
                break
            streak += 1
        first = verdicts[-streak][0]
        confirmed = streak >= CONFIRMING_DIGESTS
        label = suspects_label(suspects, majority)
        where = sorted({str(ev.ranks[r].get("node")) for r in suspects})
        evidence = [f"replica group {group}: {len(by_rank)} ranks compared at their common "
                    f"digest steps {common[0]}..{common[-1]}"]
        for step, _, _ in verdicts[-SHOWN_STEPS:]:
            bits = {r: steps[step]["bits"] for r, steps in sorted(by_rank.items())}
            evidence.append(f"step {step}: " + ", ".join(f"rank {r} {b}" for r, b in bits.items()))
        evidence.append(f"rank(s) {label} differ in {streak} consecutive digest(s), since "
                        f"step {first}" + ("" if confirmed else
                                          " (not confirmed yet: the next digest decides)"))
        title = (f"rank {label} holds weights that differ from its replicas' (silent data "
                 f"corruption since step {first} or just before)" if majority else
                 f"replicas disagree and no majority names one: {label}")
        found.append(Finding(
            "replica_divergence", title, severity="critical" if confirmed else "warning",
            confidence="high" if confirmed and majority else "medium" if confirmed else "low",
            ranks=suspects, nodes=where, evidence=evidence, runbook="TrainingReplicaDivergence",
            next_command=f"trainwatch preflight --run-dir {ev.run_dir} --only sdc   "
                         f"# on {', '.join(where)}"))
    return found


def _reduction(ev: Evidence) -> list[Finding]:
    seen = {r: v["reduction_mismatches"] for r, v in ev.ranks.items()
            if v.get("reduction_mismatches")}
    if not seen:
        return []
    steps = sorted({m["step"] for found in seen.values() for m in found})
    evidence = []
    for rank, found in sorted(seen.items()):
        last = found[-1]
        total = (ev.ranks[rank].get("counters") or {}).get("reduction_mismatches_total")
        evidence.append(
            f"rank {rank} ({ev.ranks[rank].get('node')}): {total or len(found)} mismatch(es); "
            f"the newest at step {last['step']}, bucket {last.get('bucket')}: reduced sum "
            f"{_g(last.get('reduced_sum'))}, expected {_g(last.get('expected_sum'))} "
            f"(tolerance {_g(last.get('tolerance'))})")
    shown = ", ".join(map(str, steps[-SHOWN_STEPS:]))
    return [Finding(
        "reduction_mismatch",
        f"a gradient all-reduce went wrong at step(s) {shown}: every replica applied the "
        "same wrong gradient (the replicas still agree)", severity="warning",
        ranks=sorted(seen), nodes=sorted({str(ev.ranks[r].get("node")) for r in seen}),
        evidence=evidence, runbook="TrainingReductionChecksumMismatch",
        # A checkpoint numbered N holds steps 0..N-1: those up to the first bad step predate it.
        next_command=f"trainwatch checkpoint list {ev.run_dir}   # checkpoints up to step "
                     f"{steps[0]} hold weights from before it")]


def _g(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, (int, float)) else "?"
