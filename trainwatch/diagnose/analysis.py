"""From evidence to ranked findings: who is the culprit, how sure we are, what to do.

The rules (``trainwatch/diagnose/rules/``, one module each) run in ``RULES``' order of
strength over one case file (``casefile.Analysis``); ranks already explained by an earlier,
stronger finding (dead, frozen) are not blamed again. When nothing is wrong the single
finding is ``healthy``; a run nothing will restart says so on its dead-rank findings.
"""

from __future__ import annotations

import time

from trainwatch.diagnose.casefile import Analysis, duration
from trainwatch.diagnose.model import Evidence, Finding
from trainwatch.diagnose.rules import RULES


def analyse(ev: Evidence, stall_after: float | None = None) -> list[Finding]:
    a = Analysis(ev, stall_after)
    found: list[Finding] = []
    for check in RULES:
        found += check(a)
    if not any(f.severity in ("critical", "warning") for f in found):
        found.insert(0, healthy(a))
    abandoned(a, found)
    # Among notes, the verdict on now (healthy, finished) before history (a recovered death).
    found.sort(key=lambda f: (f.sort_key()[0], f.category != "healthy", *f.sort_key()[1:]))
    return found


def abandoned(a: Analysis, found: list[Finding]) -> None:
    """A run whose ranks are all gone with none to restart them (no live supervisor, e.g.
    after a node reboot) pages until someone ends it: its dead-rank findings say since
    when, and that ``trainwatch close`` ends it (the cause first: after a reboot the
    kernel log is the previous boot's)."""
    ev = a.ev
    if ev.supervisor.get("held") is not False or not a.running \
            or any(a.proc(r) not in ("gone", "zombie") for r in a.running):
        return
    beats = [v["heartbeat_at"] for v in a.running.values()
             if isinstance(v.get("heartbeat_at"), (int, float))]
    since = (f" since its last heartbeat {duration(ev.collected_at - max(beats))} ago "
             f"({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(max(beats)))})"
             if beats else "")
    rebooted = ev.supervisor.get("rebooted_ranks")
    line = (f"abandoned{since}: every rank's process is gone and no supervisor holds the run "
            f"({ev.supervisor.get('holder') or 'its lock names none'}"
            f"{', not running' if ev.supervisor.get('holder') else ''}), so nothing will "
            "restart it and TrainingRankDown pages until it is closed or started again"
            + (f"; this node rebooted since rank(s) {rebooted} ran (their boot id is not "
               "this boot's: see the previous boot's kernel log, journalctl -k -b -1)"
               if rebooted else ""))
    for finding in found:
        if finding.category == "rank_dead" and set(finding.ranks) & set(a.running):
            finding.evidence.append(line)
            finding.next_command = f"trainwatch close {ev.run_dir}"


def healthy(a: Analysis) -> Finding:
    ev = a.ev
    states = sorted({str(v.get("state")) for v in ev.ranks.values()})
    if not ev.ranks:
        return Finding("healthy", "nothing to diagnose: no rank status found", severity="info",
                       confidence="low", evidence=list(ev.unseen[:3]))
    if states == ["finished"]:
        title, evidence = "the run finished", [f"all {len(ev.ranks)} ranks finished"]
    elif a.stopped and not a.running:
        stop = a.stop or {}
        by, event, ended = (("closed by hand", "run_closed", "were gone when it was closed")
                            if stop.get("closed") else
                            ("stopped by its supervisor", stop.get("event") or "job_stopped",
                             "ended with it (their statuses still say running: the job did "
                             "not save and stop on SIGTERM)"))
        title = f"the run was {by} ({stop.get('reason')})"
        evidence = [f"journal: {event} {duration(ev.collected_at - stop.get('time', 0.0))} ago "
                    f"({stop.get('reason')}); rank(s) {sorted(a.stopped)} {ended}"]
    elif not a.running:
        title = "the run is not running"
        evidence = [f"rank states: {', '.join(states)} (stopped: saved and stopped on request)"]
    else:
        title = "healthy: every rank is progressing"
        evidence = [f"{len(a.running)} running rank(s); last step completed "
                    f"{duration(a.progress_age)} ago (stall budget {duration(a.stall_after)})"]
        if a.step_time:
            evidence.append(f"median step time {a.step_time * 1000:.1f} ms")
    return Finding("healthy", title, severity="info", ranks=sorted(ev.ranks),
                   evidence=evidence, confidence="high" if ev.dumps or ev.stacks else "medium")
