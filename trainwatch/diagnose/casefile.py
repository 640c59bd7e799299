"""The case file every diagnose rule reads: the gathered evidence, the facts computed from it
once (running ranks, the stall budget, collective analysis), the ranks already explained,
and the wording helpers several rules share. It imports no rule, so every rule can import it.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from trainwatch.contract.collectives import crossed_waits
from trainwatch.contract.stall import default_options, published_budget, stall_budget
from trainwatch.diagnose import causes, collectives
from trainwatch.diagnose.model import Evidence, step_label
from trainwatch.diagnose.stacks import main_stack

IN_COLLECTIVE = re.compile(r"torch/distributed/|c10d")


class Analysis:
    """Shared facts the rules need, computed once, and the ranks already explained."""

    def __init__(self, ev: Evidence, stall_after: float | None):
        self.ev = ev
        # Ranks gone with a "running" status that the supervisor's last act stopped (they
        # did not save on SIGTERM): the stop, not deaths; not running either.
        self.stop = ev.journal.get("stopped")
        self.stopped = {r for r, v in ev.ranks.items()
                        if self.stop and v.get("state") == "running"
                        and self.proc(r) in ("gone", "zombie")
                        and isinstance(v.get("started_at"), (int, float))
                        and v["started_at"] <= self.stop["time"]}
        self.running = {r: v for r, v in ev.ranks.items()
                        if v.get("state") == "running" and r not in self.stopped}
        step_times = [v["recent"]["step_time"] for v in ev.ranks.values()
                      if (v.get("recent") or {}).get("step_time")]
        self.step_time = statistics.median(step_times) if step_times else None
        # The agent's stall rule: its published budget, else the options the run recorded,
        # else the defaults (an explicit --stall-after wins over all). Without a known step
        # time the floor applies: diagnose is asked because something already looks wrong.
        self.stall_options = ev.journal.get("stall_options") or default_options()
        job = (ev.run or {}).get("job") or next(
            (v.get("job") for v in ev.ranks.values() if v.get("job")), None)
        self.stall_after = stall_after or published_budget(ev.agents, job) or stall_budget(
            self.stall_options, self.step_time or 0.0, use_phase=False)
        ages = [v["progress_age"] for v in self.running.values()
                if v.get("progress_age") is not None]
        self.progress_age = min(ages) if ages else None
        self.stalled = bool(self.running) and self.progress_age is not None and \
            self.progress_age > self.stall_after
        self.groups = collectives.analyse(ev.collectives.get("groups", {}))
        ev.collectives["analysis"] = self.groups
        self.crossed = crossed_waits(self.groups)
        ev.collectives["crossed"] = self.crossed
        self.explained: set[int] = set()

    def proc(self, rank: int) -> str:
        return (self.ev.ranks[rank].get("process") or {}).get("status", "unknown")

    def node(self, rank: int) -> str:
        return str(self.ev.ranks[rank].get("node") or "?")

    def where_line(self, rank: int) -> str:
        v = self.ev.ranks[rank]
        beat = v.get("from_beat")
        source = (f" (from its beat file; its status file says step {beat['status_step']})"
                  if beat and beat.get("status_step") != v.get("step") else "")
        publish = v.get("publish")
        since = (publish or {}).get("failing_since")
        failing = (f"; it could not write its status since {duration(self.ev.collected_at - since)} "
                   f"ago: {publish.get('last_error')}" if publish and since else "")
        return (f"rank {rank} on {self.node(rank)} (pid {v.get('pid')}): step {step_label(v)}"
                f"{source}, phase {v.get('phase')} for {duration(v.get('phase_age'))}, heartbeat "
                f"{duration(v.get('heartbeat_age'))} old, last progress {duration(v.get('progress_age'))} "
                f"ago, process {self.proc(rank)}{failing}")

    def stack(self, rank: int) -> list[dict[str, Any]]:
        return main_stack(self.ev.stacks.get(rank))

    def waiting_lines(self, culprits: list[int]) -> list[str]:
        """Who waits for the culprits, and in which collective."""
        lines = []
        for pg, a in self.groups.items():
            missing = [r for r in a["behind"] if r in culprits]
            if a["waiting"] and (missing or set(culprits) - set(a["ranks"])):
                lines.append(f"process group {pg} ({a['desc']}): rank(s) {a['waiting']} wait in "
                             f"collective #{a['frontier']} {a['frontier_op']}"
                             + (f"; rank(s) {missing} never entered it" if missing else ""))
        if not lines:
            others = [r for r in self.running if r not in culprits
                      and self.proc(r) not in ("gone", "zombie", "stopped")]
            in_coll = [r for r in others if in_collective(self.stack(r))]
            if in_coll:
                lines.append(f"rank(s) {in_coll} are inside a torch.distributed call "
                             "(their stacks), waiting")
            elif others:
                lines.append(f"rank(s) {others} are alive but made no progress for "
                             f"{duration(self.progress_age)}")
        return lines


def cause_lines(cause: dict[str, Any] | None, stack: list[dict[str, Any]]) -> list[str]:
    """Evidence lines: the innermost Python line, then what the kernel shows it waits for."""
    lines = []
    inner = causes.innermost_line(stack)
    if inner:
        lines.append(f"innermost Python line: {inner}")
    if cause:
        thread = cause.get("thread") or {}
        kernel = (f" (thread {thread.get('tid')}: syscall {thread.get('syscall')}, wait channel "
                  f"{thread.get('wchan') or '-'})" if thread else "")
        lines.append(f"cause ({cause['kind']}): {causes.describe(cause)}{kernel}")
        lines.append(f"runbook section: trainwatch runbook {cause['runbook'].split('#')[0]} "
                     f"(#{cause['runbook'].split('#')[1]})")
    return lines


def in_collective(stack: list[dict[str, Any]]) -> bool:
    """Whether a stack's innermost frames are inside torch.distributed (waiting for peers)."""
    return any(IN_COLLECTIVE.search(str(f.get("file"))) for f in stack[-6:])


def duration(seconds: float | None) -> str:
    """Seconds as every finding words them; '?' when unknown, never a guess."""
    return "?" if seconds is None else f"{seconds:.1f} s"
