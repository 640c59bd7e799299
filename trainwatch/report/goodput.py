"""Goodput accounting: every second of the run's wall time in exactly one category.

The run's time line is painted with labelled intervals (steps, evaluations, checkpoint
saves, stalls, restarts, start-up); where intervals overlap the one of higher priority
wins, and what no interval covers is ``other``. Summing the painted pieces therefore
gives the wall time exactly, however messy the evidence. Definitions: docs/report.md.

Steps are never held as pieces: the few other intervals (evaluations, saves, stalls,
restarts, start-up, not running) are swept first into a time line of segments, then the
steps are painted over it in time order, a chunk of step columns at a time with numpy
(``_Painter.paint_steps``). Steps never overlap each other and lose only to "not running", so
each step piece's overlap with a segment moves from the segment's label to the piece's:
O(segments + chunk) memory. Totals are exact sums (``math.fsum``) of those moves.
"""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from trainwatch.contract.stall import default_options, recorded_options, stall_budget
from trainwatch.report import incidents as incident_evidence, kept_steps
from trainwatch.report.pieces import AfterSteps, Pieces, last_of_each, look_up
from trainwatch.report.startup_deaths import startup_cause
from trainwatch.report.steplog import StepLog
from trainwatch.report.timeline import Attempt, Timeline, number

# Order of the report; "other" is what no interval claims.
CATEGORIES = ("productive", "data_wait", "recomputed", "restart_downtime", "initial_startup",
              "checkpoint", "evaluation", "stalled", "shutdown", "other")
# Higher priority (smaller number) wins where intervals overlap.
_TIER = {"not_running": 0, "step": 1, "checkpoint": 2, "evaluation": 3, "stalled": 4,
         "restart_downtime": 5, "initial_startup": 6, "shutdown": 7}
# What makes an attempt's silent end a stall rather than a crash: the stall alert, or the
# controller's stall restart, in its journal window.
STALL_ALERTS = ("TrainingStallSuspected", "TrainingStalled")
STALL_ACTIONS = ("stall_restart",)
INCIDENT_OUTCOMES = ("interrupted", "stopped", "ended")
# Labels as small integers in the step painter's arrays.
_LABELS = (*CATEGORIES, "not_running")
_CODE = {label: i for i, label in enumerate(_LABELS)}
_STEP_CHUNK = 1 << 12  # executions painted at once: about a MiB of temporaries


@dataclass
class Incident:
    attempt: Attempt | None       # None: a supervisor died while no rank of its ran
    evidence: dict[str, Any]
    cause: str
    resumed_from: int | None
    lost_steps: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)   # recomputed/downtime/stalled
    died_at: float | None = None  # such a supervisor's death (an attempt's: its end)

    @property
    def time(self) -> float | None:
        return self.attempt.ended_at if self.attempt is not None else self.died_at

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
    productive_tokens: float | None   # job-wide: rank 0's x its attempt's world size
    processed_tokens: float | None
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

def _long_gaps(log: StepLog, budget: float) -> Iterator[int]:
    """Each i whose next step started more than ``budget`` after it ended (in chunks)."""
    for lo in range(0, len(log) - 1, kept_steps.CHUNK):
        # and the next chunk's first
        rows = log.rows(lo, min(lo + kept_steps.CHUNK, len(log) - 1) + 1)
        for i in np.nonzero(rows["start"][1:] - rows["end"][:-1] > budget)[0].tolist():
            yield lo + i


# A later attempt that resumed at or before a step threw that step's work away. Per attempt,
# those that can be the first to do so, as a chain of (index, resumed_from, next, the
# chain's earliest resume): a later attempt is left out where an earlier one resumed at or
# before it (that one always comes first), so resumes fall along the chain. Built from the
# last attempt back, each attempt joins and leaves the chain once: linear in attempts.
_Chain = tuple  # (int, int, "_Chain | None", int)


def _later_resumes(attempts: list[Attempt]) -> list[_Chain | None]:
    """Per attempt, the chain of later attempts that may discard its steps (None: none)."""
    chains: list[_Chain | None] = [None] * len(attempts)
    chain: _Chain | None = None
    for k in range(len(attempts) - 1, -1, -1):
        chains[k] = chain
        resumed = attempts[k].resumed_from
        if resumed is not None:
            while chain is not None and chain[1] >= resumed:
                chain = chain[2]
            chain = (attempts[k].index, resumed, chain,
                     chain[3] if chain is not None else resumed)
    return chains


def _is_incident(attempt: Attempt) -> bool:
    return attempt.outcome in INCIDENT_OUTCOMES


def _stall_evidence(attempt: Attempt, before: float) -> bool:
    return any(e["time"] <= before and (e.get("alert") in STALL_ALERTS
                                        if e["event"] == "alert_firing"
                                        else e.get("action") in STALL_ACTIONS)
               for e in attempt.named("alert_firing", "action_taken"))


class _Totals:
    """Per label, and per incident and label, the terms whose exact sum is the total: two
    per group of segments or of moved step time (``_groups``)."""

    def __init__(self) -> None:
        self.terms: dict[int | None, dict[str, list[float]]] = {}

    def credit(self, code: int, owner: int, *terms: float) -> None:
        """Add ``terms`` to label ``_LABELS[code]``, and to incident ``owner`` (-1: none)."""
        label = _LABELS[code]
        self.terms.setdefault(None, {}).setdefault(label, []).extend(terms)
        if owner >= 0:
            self.terms.setdefault(owner, {}).setdefault(label, []).extend(terms)

    def sums(self) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
        run = self.terms.get(None, {})
        return ({label: math.fsum(run.get(label, ())) for label in _LABELS},
                {k: {label: math.fsum(v) for label, v in d.items()}
                 for k, d in self.terms.items() if k is not None})


def _groups(key: np.ndarray, values: np.ndarray) -> Iterator[tuple[int, float, float]]:
    """(key, total, rest) per distinct key: total + rest is the sum of its values to within
    2**-106 of it (the correctly rounded sum and what it left out), so many terms become
    two and the final ``math.fsum`` is as exact as one over every term."""
    if not len(key):
        return
    order = np.argsort(key)
    key, values = key[order], values[order]
    bounds = [0, *(np.flatnonzero(key[1:] != key[:-1]) + 1).tolist(), len(key)]
    for lo, hi in zip(bounds, bounds[1:]):
        part = values[lo:hi].tolist()
        total = math.fsum(part)
        part.append(-total)
        yield int(key[lo]), total, math.fsum(part)


@dataclass
class _Segments:
    """The time line cut into segments, as columns: start, end, the winning label (code in
    ``_LABELS``) and the incident it is charged to (-1: none)."""

    start: np.ndarray
    end: np.ndarray
    label: np.ndarray
    owner: np.ndarray

    def credit(self, totals: _Totals) -> None:
        """Each segment's length to its label (and incident)."""
        width = int(self.owner.max(initial=-1)) + 2
        for key, total, rest in _groups(self.label * width + self.owner + 1,
                                        self.end - self.start):
            code, owner = divmod(key, width)
            totals.credit(code, owner - 1, total, rest)

    def move(self, totals: _Totals, start: np.ndarray, end: np.ndarray, label: np.ndarray,
             owner: np.ndarray, furthest: float) -> None:
        """Move each step piece's overlap with the segments under it from their label to
        its own (``not_running`` keeps its time). Segments are found as one forward pass
        over them would: from the furthest start of any piece so far (``furthest`` before
        these), so a piece that starts a rounding error earlier finds the same ones."""
        reach = np.maximum.accumulate(start)
        np.maximum(reach, furthest, out=reach)
        first = np.searchsorted(self.end, reach, side="right")
        count = np.maximum(np.searchsorted(self.start, end, side="left") - first, 0)
        piece = np.repeat(np.arange(len(start)), count)
        under = (np.arange(len(piece)) - np.repeat(np.cumsum(count) - count, count)
                 + np.repeat(first, count))
        overlap = (np.minimum(end[piece], self.end[under])
                   - np.maximum(start[piece], self.start[under]))
        moved = (overlap > 0) & (self.label[under] != _CODE["not_running"])
        piece, under = piece[moved], under[moved]
        width = max(int(owner.max(initial=-1)), int(self.owner.max(initial=-1))) + 2
        keys = ((label[piece] * width + owner[piece] + 1) * len(_LABELS)
                + self.label[under]) * width + self.owner[under] + 1
        for key, total, rest in _groups(keys, overlap[moved]):
            key, under_owner = divmod(key, width)
            key, under_label = divmod(key, len(_LABELS))
            code, piece_owner = divmod(key, width)
            totals.credit(code, piece_owner - 1, total, rest)
            totals.credit(under_label, under_owner - 1, -total, -rest)


class _Painter:
    """Builds the labelled pieces from a timeline: the non-step ones as columns
    (report/pieces.py), then paints the steps' over the segments those make
    (``paint_steps``)."""

    def __init__(self, tl: Timeline, typical: float | None, budget: float | None):
        self.tl, self.typical, self.budget = tl, typical, budget
        self.attempts = tl.attempts
        self.log = tl.steps
        self.pieces = Pieces()
        self.after = AfterSteps()   # step index -> end of its evaluation/save
        self.lost: dict[int, list[int]] = {}  # incident (attempt) -> steps it lost
        self.recomputed = 0

    def add(self, start: float, end: float, label: str, incident: int | None = None,
            tier: str | None = None) -> None:
        """Paint [start, end] as ``label``, with the priority of ``tier`` (default: label)."""
        start, end = max(start, self.tl.start), min(end, self.tl.end)
        if end > start:
            self.pieces.append(start, end, _CODE[label], _TIER[tier or label],
                               -1 if incident is None else incident)

    def incident_of(self, index: int) -> int | None:
        return index if 0 <= index < len(self.attempts) and _is_incident(
            self.attempts[index]) else None

    # -- steps, a chunk of columns at a time, in time order
    def paint_steps(self, segments: _Segments, totals: _Totals) -> None:
        """Paint every step execution over ``segments`` into ``totals``: a ``recomputed``
        piece when a later attempt threw it away, else its data wait, productive time and
        any excess over the stall budget (start-up, restart downtime or stalled)."""
        log, n = self.log, len(self.log)
        owners = np.array([-1 if (x := self.incident_of(a.index)) is None else x
                           for a in self.attempts], dtype=np.int64)
        firsts = np.array(log.attempt_starts, dtype=np.int64)
        later = _later_resumes(self.attempts)
        cuts = [(a.execs.lo, a.execs.hi, chain) for a in self.attempts
                if len(a.execs) and (chain := later[a.index]) is not None]
        t0, t1 = self.tl.start, self.tl.end
        last_end = furthest = -math.inf
        c = 0
        for lo, rows in log.chunks(0, n, _STEP_CHUNK):
            hi = lo + len(rows)
            while c < len(cuts) and cuts[c][1] <= lo:
                c += 1
            steps, x_start, end, waits = (rows[name] for name in ("step", "start", "end",
                                                                   "wait"))
            index = np.arange(lo, hi)
            attempt = np.searchsorted(firsts, index, side="right") - 1
            first = index == firsts[attempt]
            # an execution starts no earlier than every earlier one ended
            ended = np.maximum.accumulate(end)
            start = np.empty_like(end)
            start[0] = last_end
            np.maximum(ended[:-1], last_end, out=start[1:])
            np.maximum(x_start, start, out=start)
            last_end = max(last_end, float(ended[-1]))
            discarder = _discarders(steps, lo, hi, cuts, c)
            recomputed = discarder >= 0
            self._lose(steps, discarder, recomputed)

            length = end - start
            excess = (np.where(length > self.budget, length - self.typical, 0.0)
                      if self.typical is not None and self.budget is not None
                      else np.zeros_like(length))  # a budget comes with a typical step
            useful = length - excess
            seconds = end - x_start
            with np.errstate(divide="ignore", invalid="ignore"):
                wait = np.where(seconds > 0, useful * (waits / seconds), 0.0)
            # three pieces an execution, in time order: data wait, productive, excess
            a, b = np.empty((hi - lo, 3)), np.empty((hi - lo, 3))
            a[:, 0], b[:, 0] = np.maximum(start, t0), np.minimum(start + wait, t1)
            a[:, 1], b[:, 1] = np.maximum(start + wait, t0), np.minimum(start + useful, t1)
            a[:, 2], b[:, 2] = np.maximum(start + useful, t0), np.minimum(end, t1)
            keep = b > a
            keep[:, 2] &= excess != 0
            # a thrown-away execution is one piece, all of its time, even where it is empty
            a[recomputed, 0], b[recomputed, 0] = start[recomputed], end[recomputed]
            keep[recomputed] = (True, False, False)
            label = np.empty((hi - lo, 3), dtype=np.int64)
            label[:, 0] = np.where(recomputed, _CODE["recomputed"], _CODE["data_wait"])
            label[:, 1] = _CODE["productive"]
            # A first step's extra time is warm-up (compilation, caches), not a stall.
            label[:, 2] = np.where(first, np.where(attempt == 0, _CODE["initial_startup"],
                                                   _CODE["restart_downtime"]),
                                   _CODE["stalled"])
            owner = np.full((hi - lo, 3), -1, dtype=np.int64)
            owner[:, 0] = np.where(recomputed, owners[np.maximum(discarder - 1, 0)], -1)
            owner[:, 2] = np.where(first & (attempt > 0), owners[np.maximum(attempt - 1, 0)], -1)
            keep = keep.ravel()
            if keep.any():
                pa = a.ravel()[keep]
                segments.move(totals, pa, b.ravel()[keep], label.ravel()[keep],
                              owner.ravel()[keep], furthest)
                furthest = max(furthest, float(pa.max()))

    def _lose(self, steps: np.ndarray, discarder: np.ndarray, recomputed: np.ndarray) -> None:
        """Count the thrown-away executions, their steps under the incident before the
        attempt that threw them away."""
        if not recomputed.any():
            return
        self.recomputed += int(np.count_nonzero(recomputed))
        by, lost = discarder[recomputed], steps[recomputed]
        for k in np.unique(by).tolist():
            self.lost.setdefault(k - 1, []).extend(lost[by == k].tolist())

    # -- evaluations and checkpoint saves (both follow a step, in the same attempt)
    def evaluations_and_saves(self) -> None:
        """An evaluation from the end of the step it follows to its record; a save's
        blocking time after that step (and after its evaluation, or an earlier save of the
        same step). Held as columns (report/pieces.py), a few numbers each."""
        log = self.log
        for attempt in self.attempts:
            steps, blocking, placed = _saves(attempt)
            evals, when = last_of_each(np.frombuffer(attempt.eval_steps, dtype=np.int64),
                                       np.frombuffer(attempt.eval_times, dtype=np.float64))
            found = self._indices(attempt, np.concatenate([evals, steps - 1]))
            after_i, after_t = array("q"), array("d")
            for i, t in zip(look_up(*found, evals).tolist(), when.tolist()):
                if i >= 0 and t > log.end[i]:
                    self.add(log.end[i], t, "evaluation")
                    after_i.append(i)
                    after_t.append(t)
            spans = iter(attempt.eval_spans)
            for start, end in zip(spans, spans):  # its own length: before a first step too
                self.add(start, end, "evaluation")
            evaluated = (np.frombuffer(after_i, dtype=np.int64),
                         np.frombuffer(after_t, dtype=np.float64))
            order = np.argsort(evaluated[0], kind="stable")
            evaluated = (evaluated[0][order], evaluated[1][order])
            at = look_up(*found, steps - 1)
            saved_i, saved_t = array("q"), array("d")
            previous = -1
            # a step's saves in their order, each after the one before (stable sort: the
            # order of the journal within a step)
            for k in np.argsort(at, kind="stable").tolist():
                i = int(at[k])
                b = float(blocking[k])
                if i >= 0:
                    if i != previous:
                        anchor = self._after_evaluation(evaluated, i)
                        saved_i.append(i)
                        saved_t.append(0.0)
                    else:
                        anchor = saved_t[-1]
                    self.add(anchor, anchor + b, "checkpoint")
                    saved_t[-1] = anchor + b
                    previous = i
                else:  # e.g. a skipped step's save: placed from the event's own timing
                    self.add(float(placed[2 * k]), float(placed[2 * k + 1]), "checkpoint")
            self.after.add(evaluated[0], evaluated[1])
            self.after.add(np.frombuffer(saved_i, dtype=np.int64),
                           np.frombuffer(saved_t, dtype=np.float64))
        self.after.freeze()

    def _after_evaluation(self, evaluated: tuple[np.ndarray, np.ndarray], i: int) -> float:
        """When step ``i``'s evaluation ended, else the step's own end."""
        k = int(np.searchsorted(evaluated[0], i))
        if k < len(evaluated[0]) and evaluated[0][k] == i:
            return float(evaluated[1][k])
        return self.log.end[i]

    def _indices(self, attempt: Attempt, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Step numbers (sorted) and the index of each one's last execution in this
        attempt, of those ``wanted``."""
        rng = attempt.execs
        steps, indices = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=np.int64)]
        if len(wanted) and len(rng):
            targets = np.unique(wanted)
            for lo, rows in self.log.chunks(rng.lo, rng.hi, kept_steps.CHUNK):
                hit = np.nonzero(np.isin(rows["step"], targets))[0]
                steps.append(rows["step"][hit])
                indices.append(hit + lo)
        return last_of_each(np.concatenate(steps), np.concatenate(indices))

    # -- gaps between steps
    def gaps(self) -> None:
        log = self.log
        n = len(log)
        if not n:
            self._chain(self.tl.start, self.tl.end, list(self.attempts), head="initial_startup",
                        final=True)
            return
        first_attempt = log.attempt_of(0)
        self._chain(self.tl.start, log.start[0], self.attempts[:first_attempt],
                    head="initial_startup")
        bounds = set(log.attempt_starts)
        if self.budget is not None and n > 1:  # stalls between two steps of one attempt
            # after[i] >= end[i]: only a gap longer than the budget can hold a stall
            for i in _long_gaps(log, self.budget):
                if i + 1 >= n or (i + 1) in bounds:
                    continue
                tail = self.after.get(i, log.end[i])
                if log.start[i + 1] - tail > self.budget:
                    self.add(tail, log.start[i + 1], "stalled")
        for i in sorted(bounds - {0}):  # from one attempt's last step to the next's first
            if i == 0 or i >= n:
                continue
            e_attempt, f_attempt = log.attempt_of(i - 1), log.attempt_of(i)
            tail = self.after.get(i - 1, log.end[i - 1])
            self._tail_stall(self.attempts[e_attempt], tail)
            self._chain(log.end[i - 1], log.start[i], self.attempts[e_attempt:f_attempt],
                        head="restart_downtime")
        last_attempt = log.attempt_of(n - 1)
        self._tail_stall(self.attempts[last_attempt], self.after.get(n - 1, log.end[n - 1]))
        self._chain(log.end[n - 1], self.tl.end, self.attempts[last_attempt:],
                    head="restart_downtime", final=True)
        if self.attempts[-1].outcome != "running":  # final save's writer, exits, teardown
            self.add(log.end[n - 1], self.tl.end, "shutdown")  # (of a failure too: no restart)

    def _tail_stall(self, attempt: Attempt, tail: float) -> None:
        """From the last step (and its evaluation/save) to the attempt's end, or to the first
        rank failure torchrun saw when that came first (after it, the rest is teardown): a
        stall when the journal says so by then, or when it lasted longer than the budget."""
        if not _is_incident(attempt) or attempt.ended_at is None:
            return
        end = attempt.ended_at
        if attempt.failure_seen_at is not None:
            end = min(end, attempt.failure_seen_at)
        silent = end - tail
        if silent > 0 and (_stall_evidence(attempt, end)
                           or (self.budget is not None and silent > self.budget)):
            self.add(tail, end, "stalled", attempt.index)

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


def _sweep(pieces: Pieces, start: float, end: float) -> _Segments:
    """The time line cut into segments, each with its winning label (and incident); what
    no piece covers is ``other``. The pieces' starts and ends are walked in time order,
    a chunk of them at a time."""
    starts, ends, labels, owners = array("d"), array("d"), array("q"), array("q")
    tiers, codes, incidents = pieces.tier, pieces.label, pieces.incident
    other = _CODE["other"]
    active: set[int] = set()
    heap: list[tuple[int, int]] = []
    t = start
    n = len(pieces)
    times, positions = pieces.marks()
    for lo in range(0, len(times), _STEP_CHUNK):
        hi = lo + _STEP_CHUNK
        for when, at in zip(times[lo:hi].tolist(), positions[lo:hi].tolist()):
            opening = at >= n
            i = at - n if opening else at
            if when > t:
                while heap and heap[0][1] not in active:
                    heapq.heappop(heap)
                label, incident = other, -1
                if heap:
                    label, incident = codes[heap[0][1]], incidents[heap[0][1]]
                starts.append(t)
                ends.append(when)
                labels.append(label)
                owners.append(incident)
                t = when
            if opening:
                active.add(i)
                heapq.heappush(heap, (tiers[i], i))
            else:
                active.discard(i)
    if end > t:
        starts.append(t)
        ends.append(end)
        labels.append(other)
        owners.append(-1)
    return _Segments(*(np.frombuffer(column, dtype=np.float64 if column.typecode == "d"
                                     else np.int64) for column in (starts, ends, labels, owners)))


def _saves(attempt: Attempt) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The attempt's saves that blocked training (not a replica's copy), as columns: the
    step each saved, its blocking seconds, and start, end, start, end... where its own
    timing places it (for a save no step of the attempt precedes)."""
    steps, blocking, placed = array("q"), array("d"), array("d")
    for e in attempt.each("checkpoint_saved"):
        if e.get("copy") or not (took := number(e.get("blocking_seconds"))) \
                or not isinstance(e.get("step"), int):
            continue
        written = 0.0 if e.get("mode") == "sync" else (number(e.get("write_seconds")) or 0.0)
        steps.append(e["step"])
        blocking.append(took)
        placed.extend((e["time"] - written - took, e["time"] - written))
    return (np.frombuffer(steps, dtype=np.int64), np.frombuffer(blocking, dtype=np.float64),
            np.frombuffer(placed, dtype=np.float64))


def _discarders(steps: np.ndarray, lo: int, hi: int, cuts: list[tuple[int, int, _Chain]],
                c: int) -> np.ndarray:
    """Per execution lo..hi, the first later attempt that resumed at or before its step
    (it threw that work away), else -1. ``cuts``: (lo, hi, chain) of the attempts that
    have later resumes, in order; from ``c`` on they may reach into this chunk."""
    found = np.full(hi - lo, -1, dtype=np.int64)
    while c < len(cuts) and cuts[c][0] < hi:
        first, last, chain = cuts[c]
        part = slice(max(first, lo) - lo, min(last, hi) - lo)
        mine, into = steps[part], found[part]
        left = mine >= chain[3]
        link: _Chain | None = chain
        while link is not None and left.any():  # the chain's resumes fall: first one wins
            hit = left & (mine >= link[1])
            into[hit] = link[0]
            left &= ~hit
            link = link[2]
        c += 1
    return found


# --------------------------------------------------------------------------- the account

def account(tl: Timeline) -> Accounting:
    """Split the run's wall time into CATEGORIES and charge failures to incidents."""
    log = tl.steps
    n = len(log)
    typical = log.median_seconds()
    # The agent's stall rule, with the options the run recorded (else the defaults).
    options = recorded_options(tl.events) or default_options()
    budget = None if typical is None else stall_budget(options, typical, use_phase=False)
    painter = _Painter(tl, typical, budget)
    painter.not_running()
    painter.evaluations_and_saves()
    painter.gaps()
    segments = _sweep(painter.pieces, tl.start, tl.end)
    painter.pieces = Pieces()  # swept: not held while the steps are painted
    credits = _Totals()
    segments.credit(credits)
    painter.paint_steps(segments, credits)
    del segments
    totals, per_incident = credits.sums()
    not_running = totals.pop("not_running")
    span = tl.end - tl.start

    incidents = []
    for attempt in tl.attempts:
        if not _is_incident(attempt):
            continue
        ev = incident_evidence.evidence(attempt)
        nxt = tl.attempts[attempt.index + 1] if attempt.index + 1 < len(tl.attempts) else None
        charged = per_incident.get(attempt.index, {})
        incidents.append(Incident(
            attempt, ev, incident_evidence.cause(ev), nxt.resumed_from if nxt else None,
            sorted(painter.lost.get(attempt.index, [])),
            {"recomputed": charged.get("recomputed", 0.0),
             "restart_downtime": charged.get("restart_downtime", 0.0),
             "stalled": charged.get("stalled", 0.0)}))
    incidents = _with_startup_deaths(tl, incidents)

    unique, productive_tokens, processed_tokens, unsaved = _survivors(tl, painter)
    return Accounting(
        span_seconds=span, wall_seconds=span - not_running, not_running_seconds=not_running,
        seconds={c: totals[c] for c in CATEGORIES}, incidents=incidents,
        typical_step_seconds=typical, stall_budget_seconds=budget,
        unique_steps=unique, executed_steps=n, recomputed_steps=painter.recomputed,
        productive_tokens=productive_tokens, processed_tokens=processed_tokens,
        unsaved_steps=unsaved)


def _with_startup_deaths(tl: Timeline, incidents: list[Incident]) -> list[Incident]:
    """The attempts' incidents and each supervisor that died while no rank of its ran
    (report/startup_deaths.py), in the order they happened. Such a death lost no step; the
    time after it is not running, before it start-up or its attempt's downtime."""
    order = {id(i): float(i.attempt.index) for i in incidents if i.attempt is not None}
    for death in tl.startup_deaths:
        nxt = next((a for a in tl.attempts if a.started_at >= death.time), None)
        ev = incident_evidence.evidence(Attempt(-1, death.time, None, None,
                                                events=[death.event]))
        incidents.append(Incident(
            None, ev, startup_cause(death.event, death.after_attempt),
            nxt.resumed_from if nxt else None,
            seconds={"recomputed": 0.0, "restart_downtime": 0.0, "stalled": 0.0},
            died_at=death.time))
        order[id(incidents[-1])] = (-1 if death.after_attempt is None
                                    else death.after_attempt) + 0.5
    return sorted(incidents, key=lambda i: order[id(i)])  # stable: deaths in journal order


def _survivors(tl: Timeline, painter: _Painter
               ) -> tuple[int, float | None, float | None, int | None]:
    """Over the steps no later attempt threw away: how many distinct steps, their tokens,
    all steps' tokens (job-wide: rank 0's x its attempt's world size, as every rank trains
    a micro-batch of the same size; None unless every step recorded them and every
    attempt's world size is known), and (for a run that ended unfinished) how many
    completed after its newest saved checkpoint: lost unless someone resumes and redoes
    them. Each a pass over the log a chunk at a time (``kept_steps.kept_rows``): beyond a
    chunk, one bit per step number."""
    log = tl.steps
    cuts = _cuts(tl, painter)
    first = last = None
    sizes = np.array([np.nan if a.world_size is None else a.world_size for a in tl.attempts],
                     dtype=np.float64)
    known = len(log) > 0 and not np.isnan(sizes).any()
    for _, rows, _keep in kept_steps.kept_rows(log, cuts):
        low, high = int(rows["step"].min()), int(rows["step"].max())
        first = low if first is None else min(first, low)
        last = high if last is None else max(last, high)
        known = known and not np.isnan(rows["tokens"]).any()
    unique = 0 if first is None or last is None else kept_steps.distinct(log, cuts, first, last)
    scale = (np.asarray(log.attempt_starts, dtype=np.int64), sizes)
    productive = math.fsum(kept_steps.values(log, cuts, kept=True, scale=scale)) if known else None
    processed = math.fsum(kept_steps.values(log, cuts, kept=False, scale=scale)) if known else None
    unsaved = None
    if tl.state == "ended":
        saved = max((e["step"] for e in tl.events if e["event"] == "checkpoint_saved"
                     and isinstance(e.get("step"), int)), default=0)
        unsaved = sum(int(np.count_nonzero(rows["step"][keep] >= saved))
                      for _, rows, keep in kept_steps.kept_rows(log, cuts))
    return unique, productive, processed, unsaved


def _cuts(tl: Timeline, painter: _Painter) -> list[tuple[int, int, int]]:
    """(lo, hi, earliest later resume) of each attempt some later attempt may discard."""
    later = _later_resumes(tl.attempts) if painter.recomputed else []
    return [(a.execs.lo, a.execs.hi, chain[3]) for a in tl.attempts
            if later and len(a.execs) and (chain := later[a.index]) is not None]
