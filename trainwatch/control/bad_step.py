"""The step a rollback goes back before, found in the ranks' own metrics logs.

The loss alerts are one signal, computed by Prometheus over whatever the gauge held in its
window; a rollback throws work away, so it acts only on what the ranks logged themselves:
a non-finite loss, or a loss that is many times the mean of the same rank's steps before it
*in the same launch*. Prometheus's ``avg_over_time`` spans restarts, so a launch that
started again from an earlier checkpoint (or from scratch) reads as a spike against the
lower losses of the launch before; comparing within a launch does not.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from trainwatch.rundir.attempts import rank_of
from trainwatch.rundir.run_dir import RunDir

SPIKE_BASELINE_STEPS = 10  # a spike is measured against the mean of this many steps


def first_bad_step(run: RunDir, spike_factor: float | None = None) -> int | None:
    """The first step with a non-finite loss, else the step of the largest loss spike
    (with ``spike_factor``: only one at least that many times the mean of the
    ``SPIKE_BASELINE_STEPS`` steps before it, on the same rank, in the same launch).

    Only steps logged after the last rollback count: the metrics log keeps the records
    of a bad step that was already rolled back, and rolling back to it again would
    throw away everything trained since.
    """
    since = _last_rollback(run)
    starts = _rank_starts(run)
    nonfinite: list[int] = []
    best, best_ratio = None, spike_factor or 0.0
    for rank in run.ranks_with_metrics():
        records = [r for r in run.metrics(rank).records
                   if r.get("kind") == "step" and _is_int(r.get("step"))
                   and _logged_after(r, since)]
        for launch in _launches(records, starts.get(rank, [])):
            finite: list[float] = []
            for step, loss in launch:
                if loss is None:
                    nonfinite.append(step)
                    continue
                if len(finite) >= SPIKE_BASELINE_STEPS:
                    mean = sum(finite[-SPIKE_BASELINE_STEPS:]) / SPIKE_BASELINE_STEPS
                    if mean > 0 and loss / mean > best_ratio:
                        best, best_ratio = step, loss / mean
                finite.append(loss)
    return min(nonfinite) if nonfinite else best


def _launches(records: list[dict[str, Any]],
              starts: list[float]) -> Iterator[list[tuple[int, float | None]]]:
    """One rank's records (log order) cut where its process started again: at a
    ``rank_started`` of that rank, or where the step did not go up. Each as (step, loss),
    the loss None when it is not a finite number."""
    launch: list[tuple[int, float | None]] = []
    prev_step: int | None = None
    prev_time: float | None = None
    for r in records:
        step, t = r["step"], _number(r.get("time"))
        restarted = prev_step is not None and step <= prev_step
        if t is not None and prev_time is not None:
            restarted = restarted or any(prev_time < s <= t for s in starts)
        if restarted and launch:
            yield launch
            launch = []
        loss = _number(r.get("loss"))
        launch.append((step, loss if loss is not None and math.isfinite(loss) else None))
        prev_step, prev_time = step, (t if t is not None else prev_time)
    if launch:
        yield launch


def _last_rollback(run: RunDir) -> float:
    times = [e.get("time") for e in run.events("action_taken")
             if e.get("action") == "rollback_skip"]
    return max((t for t in times if isinstance(t, (int, float))), default=float("-inf"))


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logged_after(record: dict[str, Any], since: float) -> bool:
    """True unless the record carries a time at or before ``since``."""
    t = record.get("time")
    return not isinstance(t, (int, float)) or t > since
