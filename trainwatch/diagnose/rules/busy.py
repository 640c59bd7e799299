"""Rule: a rank burning a core outside any collective while the job stalls (busy, not frozen)."""

from __future__ import annotations

from typing import Any

from trainwatch.contract.stall import heartbeat_stale
from trainwatch.diagnose.casefile import Analysis, duration, in_collective
from trainwatch.diagnose.model import Finding
from trainwatch.diagnose.stacks import format_frames, main_thread, qualified

BUSY_CPU_PERCENT = 80.0           # main thread running or runnable, over diagnose's sample


def check_busy(a: Analysis) -> list[Finding]:
    """A rank that burns a core outside any collective while the job stalls: busy, not
    frozen. Holding the GIL in C (a regex, a C extension) also silences its telemetry
    thread, so its heartbeat looks like a frozen process's; its CPU and stack say otherwise."""
    if not a.stalled:
        return []
    waiting = {r for g in a.groups.values() for r in g["waiting"]}
    findings = []
    for rank, v in sorted(a.running.items()):
        process = v.get("process") or {}
        cpu, runnable = process.get("cpu_percent"), process.get("main_runnable_percent")
        stack = a.stack(rank)
        if rank in a.explained or rank in waiting or not isinstance(runnable, (int, float)) \
                or runnable < BUSY_CPU_PERCENT or in_collective(stack):
            continue
        a.explained.add(rank)
        main = main_thread(a.ev.stacks.get(rank)) or {}
        where = qualified(stack[-1]) if stack else "code diagnose has no stack of"
        callers = " <- ".join(f"{qualified(f)} ({_short(f)})" for f in reversed(stack[-4:]))
        evidence = [a.where_line(rank),
                    f"CPU: its main thread was running or ready to run {runnable:.0f} % of "
                    f"the time diagnose looked (on a CPU: the process used {cpu:.0f} % of a "
                    f"core; process {a.proc(rank)}): busy, not frozen"]
        if callers:
            evidence.append(f"main thread: {callers}")
        gil = main.get("owns_gil")
        stale = heartbeat_stale(a.stall_options, v.get("heartbeat_age"))
        if gil:
            evidence.append("py-spy: the main thread is active and holds the GIL"
                            + (f"; the telemetry thread could not run, so the heartbeat is "
                               f"{duration(v.get('heartbeat_age'))} old" if stale else ""))
        evidence += a.waiting_lines([rank])
        title = (f"rank {rank} is busy in {where} (main thread runnable {runnable:.0f} %)"
                 + (", holding the GIL" if gil else "") + ", while the others wait")
        findings.append(Finding(
            "rank_stuck", title, ranks=[rank], nodes=[a.node(rank)],
            confidence="high" if stack else "medium", evidence=evidence,
            runbook="TrainingStalled",
            next_command=f"py-spy top --pid {v.get('pid')}   # or: py-spy dump --pid "
                         f"{v.get('pid')} --native (the C frames under {where})",
            stack=format_frames(stack)))
    return findings


def _short(frame: dict[str, Any]) -> str:
    return f"{str(frame.get('file')).rsplit('/', 1)[-1]}:{frame.get('line')}"
