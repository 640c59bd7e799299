"""Stall detection: a running rank whose step has not advanced within its budget.

budget = max(floor, k x typical step time), or the phase's own budget (checkpoint,
eval, init), or ``first_step_seconds`` before the rank has a typical step time.
Time a phase budget covered (the rank's own phase, or the phase of a rank it waits for)
is not counted against the ordinary budget once that phase ends: the agent sees the end
of a phase before it can see the step that follows (a rank publishes its progress only
once per heartbeat), and a rank that evaluated for 90 s has not been stalled for 90 s
when it starts its next step.
The evidence decides the kind: ``dead`` (process gone or zombie; gone with a fresh heartbeat
only when this agent saw that process alive before), ``frozen``
(process stopped, or heartbeat stale: nothing in it runs), ``busy`` (the process runnable
and burning CPU outside a collective phase: with a stale heartbeat, code in C holding the
GIL, such as a catastrophic regular expression, starves the telemetry thread; with a fresh
one, a pure-Python spin) or ``stuck`` (heartbeat fresh, step stale: alive but waiting).  A finding clears by
itself as soon as the rank progresses again.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from trainwatch.contract.stall import (BUSY_CORES, BUSY_MAIN_RUNNABLE, heartbeat_stale,
                                       stall_budget)
from trainwatch.contract.states import COLLECTIVE_PHASES


@dataclass
class StallVerdict:
    stalled: bool
    kind: str | None
    budget: float
    since: float | None
    stalled_for: float
    reason: str


class StallDetector:
    def __init__(self, options: dict[str, Any]):
        self.opt = options
        self._history: dict[tuple, deque] = {}
        self._last_step: dict[tuple, Any] = {}
        # key -> (the rank's last progress, seconds since it that a phase budget covered)
        self._covered: dict[tuple, tuple[Any, float]] = {}
        # key -> the rank's pid when this agent last saw that process alive
        self._seen_alive: dict[tuple, Any] = {}

    def typical_step(self, key: tuple) -> float | None:
        history = self._history.get(key)
        return statistics.median(history) if history else None

    def observe(self, key: tuple, rank: dict[str, Any]) -> None:
        """Remember the rank's step times (one per distinct step seen)."""
        metrics = rank.get("metrics") or {}
        step, seconds = metrics.get("step"), metrics.get("step_time_seconds")
        if step is None or not isinstance(seconds, (int, float)) or seconds < 0:
            return
        if self._last_step.get(key) == step:
            return
        self._last_step[key] = step
        self._history.setdefault(key, deque(maxlen=int(self.opt["history"]))).append(seconds)

    def forget(self, keep: set[tuple]) -> None:
        for key in list(self._history):
            if key not in keep:
                self._history.pop(key, None)
                self._last_step.pop(key, None)
        for key in list(self._covered):
            if key not in keep:
                del self._covered[key]
        for key in list(self._seen_alive):
            if key not in keep:
                del self._seen_alive[key]

    def budget(self, key: tuple, phase: str | None, *, use_phase: bool = True,
               declared: dict[str, float] | None = None) -> float:
        """The rank's own budget: its phase's (declared by the job, else configured), else
        ``max(floor, k x typical step)``, else ``first_step_seconds``."""
        if use_phase and phase is not None:
            budget = self.phase_budget(phase, declared)
            if budget is not None:
                return budget
        return stall_budget(self.opt, self.typical_step(key), phase, use_phase=use_phase)

    def phase_budget(self, phase: str, declared: dict[str, float] | None = None) -> float | None:
        """A phase's own budget: what the job declared for it wins over the agent config."""
        if declared and phase in declared:
            return float(declared[phase])
        configured = self.opt["phase_budgets"].get(phase)
        return float(configured) if configured is not None else None

    def check(self, key: tuple, rank: dict[str, Any], elapsed: float = 0.0,
              holders: Sequence[PhaseHold] = ()) -> StallVerdict:
        """Is this rank stalled now, and what kind of stall is it?

        Ages are the agent's observations (``heartbeat_age``, ``progress_age``) plus
        ``elapsed``, the time since they were observed. ``holders``: ranks of the job in a
        phase with a budget (evaluation, checkpoint, declared): a rank that is alive but
        waiting inherits the budget of the phase the slowest of them is in.
        """
        self.observe(key, rank)
        phase = rank.get("phase")
        declared = rank.get("phase_budgets") or {}
        process = (rank.get("process") or {}).get("status", "unknown")
        progress_age = rank.get("progress_age")
        if rank.get("state") != "running" or progress_age is None:
            return StallVerdict(False, None, self.budget(key, phase, declared=declared), None,
                                0.0, f"rank is {rank.get('state')}")
        stalled_for = max(0.0, progress_age + elapsed)
        hb_age = rank.get("heartbeat_age")
        hb_age = hb_age + elapsed if hb_age is not None else None
        hb_stale = heartbeat_stale(self.opt, hb_age)
        if process not in ("gone", "zombie", "unknown"):
            self._seen_alive[key] = rank.get("pid")
        # Gone with a fresh heartbeat: dead if this agent saw that very process alive (it
        # was just killed); else it may be one this agent cannot see (another pid
        # namespace), which only a stale heartbeat tells apart.
        seen_die = process == "gone" and self._seen_alive.get(key) == rank.get("pid")
        if process in ("gone", "zombie") and (hb_stale or process == "zombie" or seen_die):
            return StallVerdict(True, "dead", 0.0, time.time() - stalled_for, stalled_for,
                                f"process {rank.get('pid')} is {process}")
        waiting_for, covered, excused = None, False, 0.0
        if process == "stopped" or (process == "disk_sleep" and hb_stale):
            # Nothing in the process runs (SIGSTOP, or stuck in D state with a silent
            # heartbeat): a phase budget would only delay the news.
            budget = self.budget(key, phase, use_phase=False)
            age = f"{hb_age:.1f} s" if hb_age is not None else "unknown"
            kind, why = "frozen", f"process is {process}, heartbeat {age} old"
        else:
            budget = self.budget(key, phase, declared=declared)
            covered = phase is not None and self.phase_budget(phase, declared) is not None
            busy = busy_evidence(rank.get("process") or {}) if hb_stale else None
            if busy is not None:
                kind, why = "busy", f"{busy}, heartbeat {hb_age:.1f} s old"
            elif hb_stale:
                kind, why = "frozen", f"heartbeat {hb_age:.1f} s old"
            else:
                kind, why = "stuck", "heartbeat fresh, step not advancing"
                spinning = busy_evidence(rank.get("process") or {}) \
                    if str(phase or "") not in COLLECTIVE_PHASES else None
                if spinning is not None:  # burns a CPU outside a collective: diagnose's busy
                    kind, why = "busy", f"{spinning}, heartbeat fresh, step not advancing"
                for hold in holders:
                    if hold.rank == rank.get("rank"):
                        continue
                    # The holder's phase began phase_age ago; this rank's clock started
                    # (progress_age - phase_age) before that.
                    inherited = hold.budget + max(0.0, stalled_for - hold.phase_age)
                    if inherited > budget:
                        budget, waiting_for, covered = inherited, hold, True
            excused = self._excused(key, rank, stalled_for, covered and stalled_for <= budget)
            if not covered and excused > 0.0:
                budget += excused
        if stalled_for <= budget:
            reason = "progressing" if waiting_for is None else (
                f"waiting for rank {waiting_for.rank} in {waiting_for.phase}")
            if not covered and excused > 0.0:
                reason += f" ({excused:.0f} s of it in a phase with its own budget)"
            return StallVerdict(False, None, budget, None, stalled_for, reason)
        if waiting_for is not None:
            why += (f", waiting for rank {waiting_for.rank} in {waiting_for.phase} "
                    f"(budget {waiting_for.budget:.0f} s)")
        if not covered and excused > 0.0:
            why += f", {stalled_for - excused:.1f} s since a phase with its own budget ended"
        return StallVerdict(True, kind, budget, time.time() - stalled_for, stalled_for, why)

    def _excused(self, key: tuple, rank: dict[str, Any], stalled_for: float,
                 covered_now: bool) -> float:
        """Seconds of the rank's current stretch without a step that a phase budget
        covered: remembered while covered, kept after the phase ends (the budget then
        counts from there), forgotten when the rank progresses."""
        progress = rank.get("last_progress_at")
        seen = self._covered.get(key)
        if seen is not None and (seen[0] != progress or seen[1] > stalled_for):
            del self._covered[key]  # it progressed since: a new stretch
            seen = None
        if covered_now:
            self._covered[key] = (progress, stalled_for)
            return stalled_for
        return seen[1] if seen is not None else 0.0


def busy_evidence(process: dict[str, Any]) -> str | None:
    """"R, 100 % CPU" for a process whose main thread is runnable and that uses a CPU
    (``BUSY_CORES``, or its main thread ran or waited to run ``BUSY_MAIN_RUNNABLE`` of the
    time: a loaded machine gives it less CPU), else None."""
    cores, main = process.get("cpu_cores"), process.get("main_runnable")
    if process.get("status") != "running" or not (
            (isinstance(cores, (int, float)) and cores >= BUSY_CORES)
            or (isinstance(main, (int, float)) and main >= BUSY_MAIN_RUNNABLE)):
        return None
    said = f"R, {100 * cores:.0f} % CPU" if isinstance(cores, (int, float)) else "R"
    if isinstance(main, (int, float)):
        said += f", main thread runnable {100 * main:.0f} %"
    return said


@dataclass(frozen=True)
class PhaseHold:
    """A rank in a phase with its own budget, and how long it has been in it."""

    rank: int
    phase: str
    budget: float
    phase_age: float


def phase_holds(detector: StallDetector, ranks: list[dict[str, Any]],
                elapsed: float = 0.0) -> list[PhaseHold]:
    """The job's running ranks that are in a budgeted phase (the others may wait on them).

    Only ranks this agent sees count: the local ones, or every rank when the run directory
    is shared by the job's nodes.
    """
    holds = []
    for r in ranks:
        phase, age = r.get("phase"), r.get("phase_age")
        if r.get("state") != "running" or not isinstance(phase, str) or age is None:
            continue
        budget = detector.phase_budget(phase, r.get("phase_budgets"))
        if budget is not None:
            holds.append(PhaseHold(r["rank"], phase, budget, age + elapsed))
    return holds
