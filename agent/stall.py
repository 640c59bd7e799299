"""Stall detection: a running rank whose step has not advanced within its budget.

budget = max(floor, k x typical step time), or the phase's own budget (checkpoint,
eval, init), or ``first_step_seconds`` before the rank has a typical step time.
The evidence decides the kind: ``dead`` (process gone or zombie), ``frozen``
(process stopped, or heartbeat stale: nothing in it runs) or
``stuck`` (heartbeat fresh, step stale: alive but waiting).  A finding clears by
itself as soon as the rank progresses again.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from trainwatch.contract.stall import heartbeat_stale, stall_budget



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

    def budget(self, key: tuple, phase: str | None, *, use_phase: bool = True) -> float:
        return stall_budget(self.opt, self.typical_step(key), phase, use_phase=use_phase)

    def check(self, key: tuple, rank: dict[str, Any], now: float) -> StallVerdict:
        """Is this rank stalled now, and what kind of stall is it?"""
        self.observe(key, rank)
        phase = rank.get("phase")
        progress_at = rank.get("last_progress_at") or rank.get("started_at")
        heartbeat_at = rank.get("heartbeat_at")
        process = (rank.get("process") or {}).get("status", "unknown")
        if rank.get("state") != "running" or progress_at is None:
            return StallVerdict(False, None, self.budget(key, phase), None, 0.0,
                                f"rank is {rank.get('state')}")
        stalled_for = max(0.0, now - progress_at)
        hb_age = now - heartbeat_at if heartbeat_at is not None else None
        hb_stale = heartbeat_stale(self.opt, hb_age)
        if process in ("gone", "zombie") and (hb_stale or process == "zombie"):
            return StallVerdict(True, "dead", 0.0, progress_at, stalled_for,
                                f"process {rank.get('pid')} is {process}")
        if process == "stopped" or (process == "disk_sleep" and hb_stale):
            # Nothing in the process runs (SIGSTOP, or stuck in D state with a silent
            # heartbeat): a phase budget would only delay the news.
            budget = self.budget(key, phase, use_phase=False)
            age = f"{hb_age:.1f} s" if hb_age is not None else "unknown"
            kind, why = "frozen", f"process is {process}, heartbeat {age} old"
        elif hb_stale:
            budget = self.budget(key, phase)
            kind, why = "frozen", f"heartbeat {hb_age:.1f} s old"
        else:
            budget = self.budget(key, phase)
            kind, why = "stuck", "heartbeat fresh, step not advancing"
        if stalled_for <= budget:
            return StallVerdict(False, None, budget, None, stalled_for, "progressing")
        return StallVerdict(True, kind, budget, progress_at, stalled_for, why)
