"""Goodput accounting: every second of the run's wall time in exactly one category.

The run's time line is painted with labelled intervals (steps, evaluations, checkpoint
saves, stalls, restarts, start-up); where intervals overlap the one of higher priority
wins, and what no interval covers is ``other``. Summing the painted pieces therefore
gives the wall time exactly, however messy the evidence. Definitions: docs/report.md.
"""

from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from trainwatch.contract.stall import default_options, recorded_options, stall_budget
from trainwatch.report import incidents as incident_evidence
from trainwatch.report.timeline import Attempt, StepExec, Timeline, number

# Order of the report; "other" is what no interval claims.
CATEGORIES = ("productive", "data_wait", "recomputed", "restart_downtime", "initial_startup",
              "checkpoint", "evaluation", "stalled", "shutdown", "other")
# Higher priority (smaller number) wins where intervals overlap.
_TIER = {"not_running": 0, "step": 1, "checkpoint": 2, "evaluation": 3, "stalled": 4,
         "restart_downtime": 5, "initial_startup": 6, "shutdown": 7}
# What makes an attempt's silent end a stall rather than a crash: the stall alert, or the
# controller's stall restart, in its journal window.
STALL_ALERTS = ("TrainingStalled",)
STALL_ACTIONS = ("stall_restart",)
INCIDENT_OUTCOMES = ("interrupted", "stopped", "ended")


@dataclass
class _Piece:
    start: float
    end: float
    label: str
    tier: int
    incident: int | None = None   # index of the attempt whose end it is charged to


@dataclass
class Incident:
    attempt: Attempt
    evidence: dict[str, Any]
    cause: str
    resumed_from: int | None
    lost_steps: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)   # recomputed/downtime/stalled

    @property
    def total_seconds(self) -> float:
        return math.fsum(self.seconds.values())


@dataclass
class Accounting:
    span_seconds: float
    wall_seconds: float
    not_running_seconds: float
    seconds: dict[str, float]
    incidents: list[Incident]
    typical_step_seconds: float | None
    stall_budget_seconds: float | None
    unique_steps: int
    executed_steps: int
    recomputed_steps: int
    productive_tokens_per_rank: float | None
    processed_tokens_per_rank: float | None
    unsaved_steps: int | None

    @property
    def goodput_ratio(self) -> float | None:
        return self.seconds["productive"] / self.wall_seconds if self.wall_seconds > 0 else None

    @property
    def effective_training_time_ratio(self) -> float | None:
        if self.wall_seconds <= 0:
            return None
        return (self.seconds["productive"] + self.seconds["data_wait"]) / self.wall_seconds


# --------------------------------------------------------------------------- helpers

def _discarding_attempt(attempts: list[Attempt], k: int, step: int) -> int | None:
    """The first later attempt that resumed at or before ``step``: it threw that work away."""
    for later in attempts[k + 1:]:
        if later.resumed_from is not None and later.resumed_from <= step:
            return later.index
    return None


def _is_incident(attempt: Attempt) -> bool:
    return attempt.outcome in INCIDENT_OUTCOMES


def _stall_evidence(attempt: Attempt) -> bool:
    return (any(e.get("alert") in STALL_ALERTS for e in attempt.named("alert_firing"))
            or any(e.get("action") in STALL_ACTIONS for e in attempt.named("action_taken")))


class _Painter:
    """Builds the labelled pieces from a timeline."""

    def __init__(self, tl: Timeline, typical: float | None, budget: float | None):
        self.tl, self.typical, self.budget = tl, typical, budget
        self.attempts = tl.attempts
        self.pieces: list[_Piece] = []
        self.after: dict[int, float] = {}   # id(exec) -> end of its evaluation/save
        self.wasted: dict[int, int] = {}    # id(exec) -> attempt whose incident lost it

    def add(self, start: float, end: float, label: str, incident: int | None = None,
            tier: str | None = None) -> None:
        """Paint [start, end] as ``label``, with the priority of ``tier`` (default: label)."""
        start, end = max(start, self.tl.start), min(end, self.tl.end)
        if end > start:
            self.pieces.append(_Piece(start, end, label, _TIER[tier or label], incident))

    def incident_of(self, index: int) -> int | None:
        return index if 0 <= index < len(self.attempts) and _is_incident(
            self.attempts[index]) else None

    # -- steps
    def steps(self) -> None:
        previous_end = -math.inf
        for attempt in self.attempts:
            for i, x in enumerate(attempt.execs):
                start = max(x.start, previous_end)  # never count two steps for one second
                previous_end = max(previous_end, x.end)
                discarder = _discarding_attempt(self.attempts, attempt.index, x.step)
                if discarder is not None:
                    self.wasted[id(x)] = discarder - 1
                    self.add(start, x.end, "recomputed", self.incident_of(discarder - 1),
                             tier="step")
                    continue
                self._surviving_step(attempt, i == 0, x, start)

    def _surviving_step(self, attempt: Attempt, first: bool, x: StepExec, start: float) -> None:
        length = x.end - start
        excess = 0.0
        if self.budget is not None and length > self.budget:
            excess = length - self.typical
        useful = length - excess
        wait = useful * (x.data_wait / x.seconds) if x.seconds > 0 else 0.0
        self.add(start, start + wait, "data_wait", tier="step")
        self.add(start + wait, start + useful, "productive", tier="step")
        if excess:
            # A first step's extra time is warm-up (compilation, caches), not a stall.
            if first and attempt.index == 0:
                self.add(start + useful, x.end, "initial_startup", tier="step")
            elif first:
                self.add(start + useful, x.end, "restart_downtime",
                         self.incident_of(attempt.index - 1), tier="step")
            else:
                self.add(start + useful, x.end, "stalled", tier="step")

    # -- evaluations and checkpoint saves (both follow a step, in the same attempt)
    def evaluations_and_saves(self) -> None:
        for attempt in self.attempts:
            by_step = {x.step: x for x in attempt.execs}
            for step, when in sorted(attempt.evals.items()):
                x = by_step.get(step)
                if x is not None and when > x.end:
                    self.add(x.end, when, "evaluation")
                    self.after[id(x)] = when
            for e in attempt.named("checkpoint_saved"):
                blocking = number(e.get("blocking_seconds"))
                if e.get("copy") or not blocking or not isinstance(e.get("step"), int):
                    continue
                x = by_step.get(e["step"] - 1)
                if x is not None:
                    anchor = self.after.get(id(x), x.end)
                    self.add(anchor, anchor + blocking, "checkpoint")
                    self.after[id(x)] = anchor + blocking
                else:  # e.g. a skipped step's save: placed from the event's own timing
                    written = 0.0 if e.get("mode") == "sync" else (
                        number(e.get("write_seconds")) or 0.0)
                    self.add(e["time"] - written - blocking, e["time"] - written, "checkpoint")

    # -- gaps between steps
    def gaps(self) -> None:
        execs = self.tl.execs
        if not execs:
            self._chain(self.tl.start, self.tl.end, list(self.attempts), head="initial_startup",
                        final=True)
            return
        first = execs[0]
        self._chain(self.tl.start, first.start, self.attempts[:first.attempt],
                    head="initial_startup")
        for e, f in zip(execs, execs[1:]):
            tail = self.after.get(id(e), e.end)
            if e.attempt == f.attempt:
                if self.budget is not None and f.start - tail > self.budget:
                    self.add(tail, f.start, "stalled")
                continue
            self._tail_stall(self.attempts[e.attempt], tail)
            self._chain(e.end, f.start, self.attempts[e.attempt:f.attempt],
                        head="restart_downtime")
        last = execs[-1]
        self._tail_stall(self.attempts[last.attempt], self.after.get(id(last), last.end))
        self._chain(last.end, self.tl.end, self.attempts[last.attempt:], head="restart_downtime",
                    final=True)
        if self.attempts[-1].outcome == "finished":  # final save's writer, exits, teardown
            self.add(last.end, self.tl.end, "shutdown")

    def _tail_stall(self, attempt: Attempt, tail: float) -> None:
        """From the last step (and its evaluation/save) to the attempt's end: a stall when the
        journal says so, or when it lasted longer than the stall budget."""
        if not _is_incident(attempt) or attempt.ended_at is None:
            return
        silent = attempt.ended_at - tail
        if silent > 0 and (_stall_evidence(attempt)
                           or (self.budget is not None and silent > self.budget)):
            self.add(tail, attempt.ended_at, "stalled", attempt.index)

    def _chain(self, t0: float, t1: float, ended: list[Attempt], *, head: str,
               final: bool = False) -> None:
        """Paint [t0, t1], which the ends of the ``ended`` attempts cut into segments.

        Before the first end it is ``head`` (start-up, or the interrupted attempt's own
        downtime); after each attempt's end, that incident's restart downtime up to the next
        end or t1. When ``final`` (the run's tail) the last attempt restarts nothing: what
        follows its last step or end is shutdown (see ``gaps``), never downtime.
        """
        ends = [min(max(a.ended_at if a.ended_at is not None else t1, t0), t1) for a in ended]
        points = [t0, *ends, t1]
        for i, (a, b) in enumerate(zip(points, points[1:])):
            if final and i == len(ended):
                continue  # after the last attempt's end
            if i == 0 and head == "initial_startup":
                self.add(a, b, head)
            elif i == 0:
                if not (final and len(ended) == 1):
                    self.add(a, b, head, self.incident_of(ended[0].index))
            else:
                self.add(a, b, "restart_downtime", self.incident_of(ended[i - 1].index))

    # -- gaps between launches
    def not_running(self) -> None:
        for a, b in self.tl.not_running:
            self.add(a, b, "not_running")


def _sweep(pieces: list[_Piece], start: float, end: float
           ) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """Length of the time line per winning label (and per incident); the rest is other."""
    marks: list[tuple[float, int, int]] = []
    for i, p in enumerate(pieces):
        marks += [(p.start, 1, i), (p.end, 0, i)]
    marks.sort()
    totals: dict[str, list[float]] = {c: [] for c in (*CATEGORIES, "not_running")}
    per_incident: dict[int, dict[str, list[float]]] = {}
    active: set[int] = set()
    heap: list[tuple[int, int]] = []
    t = start
    for when, opening, i in marks:
        if when > t:
            while heap and heap[0][1] not in active:
                heapq.heappop(heap)
            label, incident = "other", None
            if heap:
                piece = pieces[heap[0][1]]
                label, incident = piece.label, piece.incident
            totals[label].append(when - t)
            if incident is not None:
                per_incident.setdefault(incident, {}).setdefault(label, []).append(when - t)
            t = when
        if opening:
            active.add(i)
            heapq.heappush(heap, (pieces[i].tier, i))
        else:
            active.discard(i)
    if end > t:
        totals["other"].append(end - t)
    return ({k: math.fsum(v) for k, v in totals.items()},
            {k: {label: math.fsum(v) for label, v in d.items()} for k, d in per_incident.items()})


# --------------------------------------------------------------------------- the account

def account(tl: Timeline) -> Accounting:
    """Split the run's wall time into CATEGORIES and charge failures to incidents."""
    execs = tl.execs
    typical = statistics.median(x.seconds for x in execs) if execs else None
    # The agent's stall rule, with the options the run recorded (else the defaults).
    options = recorded_options(tl.events) or default_options()
    budget = None if typical is None else stall_budget(options, typical, use_phase=False)
    painter = _Painter(tl, typical, budget)
    painter.not_running()
    painter.steps()
    painter.evaluations_and_saves()
    painter.gaps()
    totals, per_incident = _sweep(painter.pieces, tl.start, tl.end)
    not_running = totals.pop("not_running")
    span = tl.end - tl.start

    incidents = []
    for attempt in tl.attempts:
        if not _is_incident(attempt):
            continue
        ev = incident_evidence.evidence(attempt)
        nxt = tl.attempts[attempt.index + 1] if attempt.index + 1 < len(tl.attempts) else None
        charged = per_incident.get(attempt.index, {})
        lost = sorted(x.step for x in execs if painter.wasted.get(id(x)) == attempt.index)
        incidents.append(Incident(
            attempt, ev, incident_evidence.cause(ev), nxt.resumed_from if nxt else None, lost,
            {"recomputed": charged.get("recomputed", 0.0),
             "restart_downtime": charged.get("restart_downtime", 0.0),
             "stalled": charged.get("stalled", 0.0)}))

    survivors = [x for x in execs if id(x) not in painter.wasted]
    tokens = [x.tokens for x in execs]
    known = all(t is not None for t in tokens) and bool(tokens)
    return Accounting(
        span_seconds=span, wall_seconds=span - not_running, not_running_seconds=not_running,
        seconds={c: totals[c] for c in CATEGORIES}, incidents=incidents,
        typical_step_seconds=typical, stall_budget_seconds=budget,
        unique_steps=len({x.step for x in survivors}), executed_steps=len(execs),
        recomputed_steps=len(painter.wasted),
        productive_tokens_per_rank=math.fsum(x.tokens for x in survivors) if known else None,
        processed_tokens_per_rank=math.fsum(tokens) if known else None,
        unsaved_steps=_unsaved(tl, survivors))


def _unsaved(tl: Timeline, survivors: list[StepExec]) -> int | None:
    """A run that ended unfinished: completed steps after its newest saved checkpoint (they
    are lost unless someone resumes and redoes them). None for finished or running runs."""
    if tl.state != "ended":
        return None
    saved = [e["step"] for e in tl.events if e["event"] == "checkpoint_saved"
             and isinstance(e.get("step"), int)]
    newest = max(saved, default=0)
    return sum(1 for x in survivors if x.step >= newest)
