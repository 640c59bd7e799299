"""The step a rollback goes back before, found in the ranks' own metrics logs.

The loss alerts are one signal, computed by Prometheus over whatever the gauge held in its
window; a rollback throws work away, so it acts only on what the ranks logged themselves:
a non-finite loss, or a loss that is many times the mean of the same rank's steps before it
*in the same launch*. Prometheus's ``avg_over_time`` spans restarts, so a launch that
started again from an earlier checkpoint (or from scratch) reads as a spike against the
lower losses of the launch before; comparing within a launch does not.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Any, Iterator

from trainwatch.rundir.attempts import rank_of
from trainwatch.rundir.jsonl import iter_jsonl
from trainwatch.rundir.run_dir import RunDir

SPIKE_BASELINE_STEPS = 10  # a spike is measured against the mean of this many steps
LOOKBACK_BYTES = 64 << 20  # of each rank's metrics log: ~160,000 steps of ~400 bytes


def first_bad_step(run: RunDir, since: float = float("-inf"),
                   spike_factor: float | None = None) -> int | None:
    """The first step with a non-finite loss, else the step of the largest loss spike
    (with ``spike_factor``: only one more than that many times the mean of the
    ``SPIKE_BASELINE_STEPS`` steps before it, on the same rank, in the same launch).

    Only steps logged after ``since`` count (the last rollback: the metrics log keeps the
    records of a bad step that was already rolled back, and rolling back to it again would
    throw away everything trained since). Each log is read as a stream, and only its last
    ``LOOKBACK_BYTES``: a rollback is asked for within minutes of its bad step, and a
    million-step log read whole held gigabytes in the supervisor.
    """
    starts = _rank_starts(run)
    nonfinite: int | None = None
    best, best_ratio = None, spike_factor or 0.0
    for rank in run.ranks_with_metrics():
        for step, ratio in _scan(_steps(run, rank, since), starts.get(rank, [])):
            if ratio is None:
                nonfinite = step if nonfinite is None else min(nonfinite, step)
            elif ratio > best_ratio:
                best, best_ratio = step, ratio
    return nonfinite if nonfinite is not None else best


def _steps(run: RunDir, rank: int, since: float) -> Iterator[tuple[int, float | None, Any]]:
    """(step, loss, time) of the rank's step records logged after ``since``, in log order;
    the loss a float (NaN and the infinities as json wrote them) or None where the step
    recorded none (a loop that records it every few steps), the time a float or None."""
    skipped: list[Any] = []
    for _, r in iter_jsonl(run.metrics_file(rank), skipped, run.root,
                           tail_bytes=LOOKBACK_BYTES):
        skipped.clear()  # bad lines are the report's to count, not kept here
        step = r.get("step")
        if r.get("kind") != "step" or not isinstance(step, int) or isinstance(step, bool):
            continue
        t = _number(r.get("time"))
        if t is not None and t <= since:
            continue
        yield step, _number(r.get("loss")), t


def _scan(steps: Iterator[tuple[int, float | None, Any]],
          starts: list[float]) -> Iterator[tuple[int, float | None]]:
    """One rank's bad-step candidates: (step, None) for a non-finite loss, (step, ratio)
    for a finite one with ``SPIKE_BASELINE_STEPS`` finite ones before it in its launch
    (ratio: its loss over their mean). A launch ends where the rank's process started
    again: at a ``rank_started`` of that rank, or where the step did not go up."""
    window: deque[float] = deque(maxlen=SPIKE_BASELINE_STEPS)
    starts = sorted(starts)
    prev_step: int | None = None
    prev_time: float | None = None
    for step, loss, t in steps:
        restarted = prev_step is not None and step <= prev_step
        if t is not None and prev_time is not None and not restarted:
            after = bisect.bisect_right(starts, prev_time)  # a start in (prev_time, t]?
            restarted = after < len(starts) and starts[after] <= t
        if restarted:
            window.clear()
        prev_step, prev_time = step, (t if t is not None else prev_time)
        if loss is None:  # no loss recorded at this step: nothing to judge
            continue
        if not math.isfinite(loss):
            yield step, None
            continue
        if len(window) == SPIKE_BASELINE_STEPS:
            mean = sum(window) / SPIKE_BASELINE_STEPS
            if mean > 0:
                yield step, loss / mean
        window.append(loss)


def _rank_starts(run: RunDir) -> dict[int, list[float]]:
    starts: dict[int, list[float]] = {}
    for event in run.events("rank_started"):
        rank, t = rank_of(event), event.get("time")
        if rank is not None and isinstance(t, (int, float)) and not isinstance(t, bool):
            starts.setdefault(rank, []).append(float(t))
    return starts


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None

