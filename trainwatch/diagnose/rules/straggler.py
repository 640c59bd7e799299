"""Rule: a slow rank in a run that still progresses: late into collectives, or slow locally."""

from __future__ import annotations

import statistics

from trainwatch.contract.timing import job_window
from trainwatch.diagnose.casefile import Analysis, duration
from trainwatch.diagnose.model import Finding

STRAGGLER_LATENESS_RATIO = 0.15   # entering collectives this much of a step after the others
STRAGGLER_LATENESS_FLOOR = 0.02   # seconds: below this it is scheduling noise
STRAGGLER_TIMING_RATIO = 1.3      # local time vs the job median


def check_straggler(a: Analysis) -> list[Finding]:
    """A slow rank in a run that still progresses: late into collectives, or slow locally."""
    if a.stalled or len(a.running) < 2 or set(a.running) <= a.explained:
        return []
    step = a.step_time or 0.0
    for pg, g in a.groups.items():
        late = g.get("lateness") or {}
        if len(late) < 2 or not step:
            continue
        rank = max(late, key=lambda r: late[r])
        if rank not in a.explained and late[rank] >= max(STRAGGLER_LATENESS_RATIO * step, STRAGGLER_LATENESS_FLOOR):
            others = statistics.median(v for r, v in late.items() if r != rank)
            return [_straggler(a, rank, [
                f"process group {pg}: rank {rank} enters collectives {late[rank] * 1000:.0f} ms "
                f"after the first rank (median over recent collectives; others "
                f"{others * 1000:.0f} ms); step time {step * 1000:.0f} ms"], "high")]
    window = job_window({r: v.get("timing") for r, v in a.running.items()})
    if window and window["job"]["ranks"] >= 2:
        # Time outside collective phases, from the job summary every rank publishes.
        job = window["job"]
        rank, slowest, median = job.get("slowest_rank"), job["max"], job["median"]
        if isinstance(rank, int) and median > 0 and slowest / median >= STRAGGLER_TIMING_RATIO \
                and rank in a.ev.ranks and rank not in a.explained:
            own = a.ev.ranks[rank].get("timing") or {}
            data = own.get("data_wait_seconds") if own.get("step") == window["step"] else None
            cause = (" (mostly waiting for data)"
                     if isinstance(data, (int, float)) and data >= 0.5 * slowest else "")
            return [_straggler(a, rank, [
                f"rank {rank} local time {slowest * 1000:.0f} ms per step vs job median "
                f"{median * 1000:.0f} ms ({slowest / median:.2f}x){cause}"], "medium")]
    return []


def _straggler(a: Analysis, rank: int, evidence: list[str], confidence: str) -> Finding:
    evidence.append(f"the job still progresses (last step {duration(a.progress_age)} ago): "
                    "slow, not stalled")
    return Finding("straggler", f"rank {rank} is a straggler (slow but progressing)",
                   severity="warning", confidence=confidence, ranks=[rank],
                   nodes=[a.node(rank)], evidence=[a.where_line(rank), *evidence],
                   runbook="TrainingStragglerRank",
                   next_command=f"py-spy top --pid {a.ev.ranks[rank].get('pid')}")
