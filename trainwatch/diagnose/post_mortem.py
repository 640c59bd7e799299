"""A hang the deaths ended: whom the dead ranks waited for, from the evidence they left.

Strongest first: the flight-recorder dumps saved while they hung (``saved_evidence.py``:
``diagnostics/dump-rank-*.json``, the controller's ``stall-*/``), which say per process
group who waited in which collective and who never entered it — the same decision as a
live diagnose's (``trainwatch/contract/collectives.py``); then the ranks' last phases, which
only say where the loop meant to be (a user's own phase may hold a collective). The finding
says which evidence it rests on, which it could not read, and is never surer than that.
"""

from __future__ import annotations

from typing import Any

from trainwatch.contract.collectives import crossed_waits, never_entered
from trainwatch.contract.states import COLLECTIVE_PHASES, KNOWN_PHASES
from trainwatch.diagnose import causes, collectives
from trainwatch.diagnose.casefile import Analysis, duration
from trainwatch.diagnose.flight_recorder import groups_of
from trainwatch.diagnose.model import Finding
from trainwatch.diagnose.stacks import format_frames, main_stack
from trainwatch.rundir.torchrun_log import failure_time


def hang_before_death(a: Analysis, dead: list[int],
                      root: dict[str, Any] | None) -> Finding | None:
    """Dead ranks whose job had stopped progressing well before they died: the deaths
    ended a hang (a timeout, the launcher, an operator), the hang is what to explain.

    The job's last progress is the newest step any rank completed; its death, the last
    heartbeat of a dead rank, or torchrun's first observed failure (``root``) when that was
    earlier: a rank that outlived a killed peer (finishing a slow batch, deferring SIGTERM
    until its step ends) beats on without a step, which is teardown, not a hang.
    """
    ranks = a.ev.ranks
    ages = [v["progress_age"] for v in ranks.values()
            if isinstance(v.get("progress_age"), (int, float))]
    deaths = [ranks[r]["heartbeat_at"] for r in dead
              if isinstance(ranks[r].get("heartbeat_at"), (int, float))]
    if not ages or not deaths:
        return None
    progress_at = a.ev.collected_at - min(ages)
    died_at, death = max(deaths), "the last heartbeat of a dead rank"
    observed = failure_time((root or {}).get("time"))
    # torchrun's time is its poll's, to the second: the death was before the next second.
    # One before the job's last progress is another clock (a time zone): not evidence.
    if observed is not None and progress_at - a.stall_after <= observed + 1 < died_at:
        died_at, death = observed + 1, "torchrun observed the first failure"
    stalled = died_at - progress_at
    if stalled <= a.stall_after:
        return None
    evidence = [f"the last step any rank completed was {duration(stalled)} before {death} "
                f"(stall budget {duration(a.stall_after)}): the run was already stalled when its "
                "ranks died"]
    evidence += [a.where_line(r) for r in sorted(dead)]
    verdict = from_dumps(a, sorted(dead), progress_at, died_at) or from_phases(a, sorted(dead))
    culprits, confidence, said, lines = verdict
    stack = _stack(a, culprits[0]) if len(culprits) == 1 else []
    if stack:
        lines += [f"rank {culprits[0]}'s innermost Python line when saved: "
                  f"{causes.innermost_line(stack)}"]
    return Finding("rank_stuck", f"the run was stalled for {duration(stalled)} before it died"
                   + said, ranks=culprits, confidence=confidence,
                   nodes=sorted({a.node(r) for r in culprits}),
                   evidence=evidence + lines + sources(a), runbook="TrainingStalled",
                   next_command=f"grep -n -E 'Error|Signal|timeout' {a.ev.run_dir}/logs/*.log "
                                "| head   # then reproduce with diagnose while it hangs",
                   stack=format_frames(stack))


Verdict = tuple[list[int], str, str, list[str]]  # culprits, confidence, title tail, evidence


def from_dumps(a: Analysis, dead: list[int], progress_at: float,
               died_at: float) -> Verdict | None:
    """Whom the ranks waited for, from the flight recorders they dumped while hanging (after
    the job's last step): high when every dead rank left one, medium when some did not."""
    saved = a.ev.saved.get("dumps") or {}
    dumps = {r: s["dump"] for r, s in saved.items() if r in dead and s["time"] >= progress_at}
    groups = collectives.analyse(groups_of(dumps))
    if not groups:
        return None
    busy = {r for g in groups.values() for r in g["waiting"]} | {
        r for g in groups.values() for r, b in g["behind"].items() if b["in_collective"]}
    ago = sorted(died_at - saved[r]["time"] for r in dumps)
    when = duration(ago[0]) if ago[-1] - ago[0] < 0.1 else \
        f"{duration(ago[0])} to {duration(ago[-1])}"
    lines = [f"flight-recorder dumps of rank(s) {sorted(dumps)}, saved {when} before the ranks "
             "died, while they hung (no step completed after them)"]
    missing = never_entered(groups, busy)
    crossed = sorted(crossed_waits(groups), key=lambda c: c["tie"])
    if missing:
        culprits = sorted({r for m in missing for r in m["culprits"]})
        m = missing[0]
        said = (f": rank(s) {culprits} did not enter collective #{m['seq']} of process group "
                f"{m['group']}, which rank(s) {m['waiting']} waited in")
        lines += [f"process group {x['group']}: rank(s) {x['waiting']} waited in collective "
                  f"#{x['seq']} {groups[x['group']]['frontier_op'] or ''}; rank(s) "
                  f"{x['culprits']} never entered it and were in no collective" for x in missing]
    elif crossed:
        c, other = crossed[0], crossed[0]["waits_in"]
        culprits = sorted(c["culprits"] + c["waiting"]) if c["tie"] else c["culprits"]
        lines += [f"process group {c['group']}: rank(s) {c['waiting']} waited in collective "
                  f"#{c['seq']} {c['op'] or ''}, which rank(s) {c['culprits']} never entered",
                  f"process group {other['group']}: rank(s) {c['culprits']} waited in "
                  f"collective #{other['seq']} {other['op'] or ''}, which rank(s) "
                  f"{c['waiting']} never entered: one side skipped a collective (or issued an "
                  "extra one)"]
        said = (f": ranks {c['culprits']} and {c['waiting']} waited in different collectives; "
                "which side skipped one cannot be told (equal sides)" if c["tie"] else
                f": rank(s) {c['culprits']} did not enter collective #{c['seq']} of process "
                f"group {c['group']}, which rank(s) {c['waiting']} waited in")
        if c["tie"]:
            return culprits, "low", said, lines
    else:
        return None
    absent = sorted(set(dead) - set(dumps))
    if absent:
        lines.append(f"rank(s) {absent} left no dump from the hang: the verdict rests on the "
                     "others' (medium)")
    return culprits, "medium" if absent else "high", said, lines


def from_phases(a: Analysis, dead: list[int]) -> Verdict:
    """Whom the ranks waited for, from their last phases: a rank in a phase of trainwatch's
    own outside collectives (data, checkpoint...) against others in collective phases is
    medium; a user's own phase may hold a collective (issue #36), so it is low."""
    phases = {r: str(a.ev.ranks[r].get("phase") or "") for r in dead}
    outside = sorted(r for r, p in phases.items() if p and p not in COLLECTIVE_PHASES)
    inside = sorted(r for r, p in phases.items() if p in COLLECTIVE_PHASES)
    if not (outside and inside):
        return (sorted(phases), "low", "; whom it waited for cannot be told from the "
                "evidence it left", ["no flight-recorder dump from the hang, and the last "
                                     "phases do not tell who waited for whom"])
    names = sorted({phases[r] for r in outside})
    own = [p for p in names if p not in KNOWN_PHASES]
    lines = [f"rank(s) {outside} in phase(s) {', '.join(names)}; rank(s) {inside} in "
             "collective phases, waiting for them (from the last statuses: no live process "
             "and no flight-recorder dump from the hang to confirm it)"]
    if own:
        lines.append(f"phase(s) {', '.join(own)} are the job's own: one may hold a collective "
                     "(a side group's all_reduce), so the ranks in it may have been the ones "
                     "waiting (low confidence)")
    return (outside, "low" if own else "medium",
            f": rank(s) {outside} were outside a collective while the others waited in one"
            if not own else f": rank(s) {outside} were in phase(s) {', '.join(own)}, the others "
            "in collective phases; who waited for whom is not certain", lines)


def sources(a: Analysis) -> list[str]:
    """Which saved evidence the post-mortem used, which it did not (why), which it could
    not read (why)."""
    saved = a.ev.saved
    if not saved:
        return [f"saved evidence: none in {a.ev.run_dir}/diagnostics/ of these processes (no "
                "dump or stall evidence taken while they hung)"]
    lines = [f"saved evidence used: {', '.join(saved['used']) or 'none'}"]
    lines += [f"saved evidence not used: {x}" for x in saved["not_used"]]
    lines += [f"saved evidence unreadable: {x}" for x in saved["unreadable"]]
    return lines


def _stack(a: Analysis, rank: int) -> list[dict[str, Any]]:
    """The rank's main-thread stack from its saved dump, else the controller's py-spy."""
    dump = (a.ev.saved.get("dumps") or {}).get(rank)
    if dump:
        frames = main_stack({"threads": [
            {"name": t.get("name"), "frames": t.get("frames") or [],
             "telemetry": bool(t.get("dumper"))}
            for t in dump["dump"].get("threads") or [] if isinstance(t, dict)]})
        if frames:
            return frames
    return ((a.ev.saved.get("py_spy") or {}).get(rank) or {}).get("frames") or []
