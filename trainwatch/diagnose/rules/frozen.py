"""Rule: a rank stopped (state T), blocked in uninterruptible I/O, or frozen (stale
heartbeat, process not visible)."""

from __future__ import annotations

from trainwatch.contract.stall import heartbeat_stale
from trainwatch.diagnose.casefile import Analysis, duration
from trainwatch.diagnose.model import Finding
from trainwatch.diagnose.stacks import format_frames


def check_frozen(a: Analysis) -> list[Finding]:
    findings = []
    for rank, v in a.running.items():
        if rank in a.explained:
            continue
        status = a.proc(rank)
        hb = v.get("heartbeat_age")
        blocked = (v.get("process") or {}).get("threads_in_disk_sleep") or []
        if status == "stopped":
            title, runbook = f"rank {rank} is stopped (state T: SIGSTOP or a debugger)", \
                "TrainingStalled"
            cmd, category = f"grep State /proc/{v.get('pid')}/status   # then: kill -CONT " \
                            f"{v.get('pid')}", "rank_stuck"
        elif status == "disk_sleep" or (blocked and a.stalled):
            wchans = ", ".join(sorted({b["wchan"] for b in blocked}))
            title = (f"rank {rank} is blocked in uninterruptible I/O (D state"
                     + (f", in {wchans})" if wchans else ")"))
            runbook, category = "StorageProbeSlow", "storage"
            remote = f"ssh {a.node(rank)} " if (v.get("process") or {}).get("via") else ""
            cmd = f"{remote}cat /proc/{v.get('pid')}/stack; {remote}df -h {a.ev.run_dir}"
        elif status == "unknown" and heartbeat_stale(a.stall_options, hb):
            title = f"rank {rank} is frozen or dead (heartbeat {duration(hb)} old)"
            runbook, category = "TrainingStalled", "rank_stuck"
            cmd = f"ssh {a.node(rank)} py-spy dump --pid {v.get('pid')}"
        else:
            continue
        a.explained.add(rank)
        evidence = [a.where_line(rank)] + a.waiting_lines([rank])
        findings.append(Finding(category, title, ranks=[rank], nodes=[a.node(rank)],
                                confidence="high" if status != "unknown" else "medium",
                                evidence=evidence, runbook=runbook, next_command=cmd,
                                stack=format_frames(a.stack(rank))))
    return findings
