"""Rule: across nodes, the rank that went silent first while the others beat on without
a step is the culprit; the ranks that died later waiting for it are its victims.

From one node the other nodes' processes cannot be seen, and by the time diagnose runs a
frozen rank's job has usually come apart: its node's launcher gave up, the others were
stopped by a restart or failed in the collective. The run directory they share keeps
the order. A frozen (or killed) rank's telemetry thread stops with it; the ranks waiting
for it in a collective keep beating, completing no step, until they die too. So the rank
whose heartbeat stopped first, well before every other rank's (more than
``heartbeat_stale_seconds`` and three beats), while no other rank completed a step after
it, is named, and the later deaths are not blamed as causes. Only for jobs on several
nodes (on one node the process states tell it: rules ``dead`` and ``frozen``), and not for
a rank whose death this host sees or torchrun's log names: ``dead`` says it in their words.
"""

from __future__ import annotations

from typing import Any

from trainwatch.diagnose.casefile import Analysis, duration
from trainwatch.diagnose.model import Finding
from trainwatch.diagnose.stacks import format_frames

_LIVE = ("running", "failed")  # not finished, not stopped cleanly


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def check_first_silent(a: Analysis) -> list[Finding]:
    ev = a.ev
    if len({v.get("node") for v in ev.ranks.values()}) < 2:
        return []
    beats = {r: hb for r, v in ev.ranks.items() if v.get("state") in _LIVE
             and r not in a.explained and (hb := _number(v.get("heartbeat_at"))) is not None}
    if len(beats) < 2:
        return []
    interval = max((_number(v.get("heartbeat_interval")) or 1.0 for v in ev.ranks.values()),
                   default=1.0)
    margin = max(float(a.stall_options["heartbeat_stale_seconds"]), 3 * interval)
    first = min(beats.values())
    culprits = sorted(r for r, hb in beats.items() if hb - first <= interval)
    # The others that were alive when it went silent (a rank started since is another attempt).
    others = sorted(r for r in beats if r not in culprits
                    and (_number(ev.ranks[r].get("started_at")) or first) <= first)
    if not others or len({a.node(r) for r in culprits}) > 1 \
            or min(beats[o] for o in others) - first <= margin:
        return []
    root = ev.launcher.get("root_cause") or {}
    if any(a.proc(r) in ("gone", "zombie") or root.get("rank") == r for r in culprits):
        return []  # a death seen here or in torchrun's words: ``dead`` names it with them
    slack = max(2 * (a.step_time or 0.0), 2 * interval)
    stepped = [o for o in others if (done := _progress_at(ev.ranks[o], ev.collected_at))
               is not None and done > first + slack]
    if stepped:
        return []  # the job went on without it: not what held it up
    a.explained |= set(culprits) | set(others)
    return [_finding(a, culprits, others, beats, first, margin)]


def _progress_at(view: dict[str, Any], now: float) -> float | None:
    age = _number(view.get("progress_age"))
    return None if age is None else now - age


def _finding(a: Analysis, culprits: list[int], others: list[int], beats: dict[int, float],
             first: float, margin: float) -> Finding:
    ev, rank = a.ev, culprits[0]
    node = a.node(rank)
    gap = min(beats[o] for o in others) - first
    named = _alert_naming(ev.journal.get("events", []), culprits)
    status = a.proc(rank)
    what = "stopped (state T: SIGSTOP or a debugger)" if status == "stopped" else (
        f"frozen or dead: its process is on {node}, not visible from {ev.host}"
        if status == "unknown" else f"frozen: its process is {status}")
    who = f"rank {rank}" if len(culprits) == 1 else f"ranks {culprits}"
    title = (f"{who} on {node} held the job up: {'its' if len(culprits) == 1 else 'their'} "
             f"heartbeat stopped first, {duration(gap)} before any other rank's, "
             f"while the others beat on without a step; {what}")
    evidence = [a.where_line(r) for r in culprits]
    evidence.append(f"rank(s) {others} kept beating up to {duration(max(beats[o] for o in others) - first)} "
                    f"after it and completed no step after it went silent: they waited for "
                    f"it, and what ended them (a restart, a failed collective, their "
                    f"launcher's exit) followed; victims, not causes")
    for victim in others:
        failure = ev.ranks[victim].get("failure")
        message = failure.get("message") if isinstance(failure, dict) else None
        if message:
            evidence.append(f"rank {victim} on {a.node(victim)} then failed: {str(message)[:160]}")
    if named:
        evidence.append(named)
    confidence = "high" if gap > 2 * margin or named else "medium"
    cmd = (f"kill -CONT {ev.ranks[rank].get('pid')}   # or py-spy dump --pid "
           f"{ev.ranks[rank].get('pid')}" if status == "stopped"
           else f"ssh {node} py-spy dump --pid {ev.ranks[rank].get('pid')}   # if it still runs; "
                f"else its log: {ev.run_dir}/logs/torchrun/")
    return Finding("rank_stuck", title, ranks=culprits, nodes=[node], confidence=confidence,
                   evidence=evidence, runbook="TrainingStalled", next_command=cmd,
                   stack=format_frames(a.stack(rank)))


def _alert_naming(events: list[dict[str, Any]], culprits: list[int]) -> str | None:
    """The newest stall alert whose culprit_rank is one of ``culprits`` (the agent's view)."""
    for event in reversed(events):
        labels = event.get("labels") if isinstance(event.get("labels"), dict) else {}
        if event.get("event") == "alert_firing" and str(labels.get("culprit_rank")) in {
                str(r) for r in culprits}:
            return (f"the agent named it too: {event.get('alert')} "
                    f"culprit_rank={labels.get('culprit_rank')} node={labels.get('node')} "
                    f"(journal)")
    return None
