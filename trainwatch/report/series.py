"""Time series for the report's charts, read in one pass and downsampled as they are read.

A long run's metrics logs hold millions of lines; a chart needs a few thousand points.
Every series here keeps a bounded number of points whatever the run's length: when a
series fills up, neighbouring points are merged pairwise (means for values, so a spike
still moves its bucket) and the stride doubles. Memory is O(points x ranks), never
O(steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.jsonl import iter_jsonl

MAX_POINTS = 2000        # loss / step-time points over wall time
MAX_BUCKETS = 200        # heatmap columns (step buckets)
MAX_RANKS = 512          # heatmap rows; more ranks are sampled evenly
# Journal events drawn on the charts.
MARKED_EVENTS = ("rank_started", "restarted", "alert_firing", "action_taken", "failed",
                 "checkpoint_saved", "checkpoint_failed", "nonfinite_detected")


@dataclass
class Decimated:
    """Points (time, step, loss, step seconds) averaged over ``stride`` consecutive steps."""

    limit: int = MAX_POINTS
    stride: int = 1
    points: list[list[float | None]] = field(default_factory=list)
    _acc: list[list[float | None]] = field(default_factory=list)

    def add(self, t: float, step: int, loss: float | None, seconds: float | None) -> None:
        self._acc.append([t, step, loss, seconds])
        if len(self._acc) >= self.stride:
            self.points.append(_mean_rows(self._acc))
            self._acc = []
            if len(self.points) >= self.limit:
                self.points = [_mean_rows(self.points[i:i + 2])
                               for i in range(0, len(self.points), 2)]
                self.stride *= 2

    def finish(self) -> list[list[float | None]]:
        if self._acc:
            self.points.append(_mean_rows(self._acc))
            self._acc = []
        return self.points


def _mean_rows(rows: list[list[float | None]]) -> list[float | None]:
    """Last time and step of the rows, mean of each value that is present."""
    out: list[float | None] = [rows[-1][0], rows[-1][1]]
    for col in range(2, len(rows[0])):
        values = [v for r in rows if (v := r[col]) is not None]
        out.append(sum(values) / len(values) if values else None)
    return out


@dataclass
class StepBuckets:
    """Mean step time per bucket of ``width`` steps; buckets merge pairwise when full."""

    limit: int = MAX_BUCKETS
    width: int = 1
    sums: dict[int, list[float]] = field(default_factory=dict)   # bucket -> [sum, count]

    def add(self, step: int, seconds: float) -> None:
        cell = self.sums.setdefault(step // self.width, [0.0, 0])
        cell[0] += seconds
        cell[1] += 1
        if len(self.sums) > self.limit:
            merged: dict[int, list[float]] = {}
            for bucket, (total, count) in self.sums.items():
                cell = merged.setdefault(bucket // 2, [0.0, 0])
                cell[0] += total
                cell[1] += count
            self.sums = merged
            self.width *= 2

    def means(self, width: int) -> dict[int, float]:
        """Means re-bucketed to ``width`` (a multiple of this one's), keyed by first step."""
        out: dict[int, list[float]] = {}
        for bucket, (total, count) in self.sums.items():
            first = bucket * self.width // width * width
            cell = out.setdefault(first, [0.0, 0])
            cell[0] += total
            cell[1] += count
        return {first: total / count for first, (total, count) in out.items() if count}


@dataclass
class Series:
    loss: list[list[float | None]]                 # [time, step, loss, step seconds]
    stride: int                                    # steps per point
    heatmap_ranks: list[int]
    heatmap_steps: list[int]                       # first step of each column
    heatmap: list[list[float | None]]              # [rank row][column] mean step seconds
    events: list[dict[str, Any]]                   # MARKED_EVENTS, trimmed to a few fields


def read_series(run: RunDir) -> Series:
    loss = Decimated()
    for record in _lines(run.metrics_file(0), run.root):
        if record.get("kind") == "step" and _num(record.get("time")) is not None \
                and isinstance(record.get("step"), int):
            loss.add(float(record["time"]), record["step"], _num(record.get("loss")),
                     _num(record.get("step_time_seconds")))
    ranks = run.ranks_with_metrics()
    if len(ranks) > MAX_RANKS:
        ranks = [ranks[i * len(ranks) // MAX_RANKS] for i in range(MAX_RANKS)]
    buckets = {}
    for rank in ranks:
        b = buckets[rank] = StepBuckets()
        for record in _lines(run.metrics_file(rank), run.root):
            seconds = _num(record.get("step_time_seconds"))
            if record.get("kind") == "step" and isinstance(record.get("step"), int) \
                    and seconds is not None:
                b.add(record["step"], seconds)
    width = max((b.width for b in buckets.values()), default=1)
    means = {rank: b.means(width) for rank, b in buckets.items()}
    columns = sorted({first for m in means.values() for first in m})
    heatmap = [[means[rank].get(first) for first in columns] for rank in ranks]
    events = [_trim(e) for e in _lines(run.journal_file, run.root)
              if e.get("event") in MARKED_EVENTS and _num(e.get("time")) is not None]
    return Series(loss.finish(), loss.stride, ranks, columns, heatmap, events)


def _lines(path: Path, root: Path) -> Iterator[dict[str, Any]]:
    """JSON-lines records one at a time through the run directory's hostile-file-safe
    reader; torn, alien or overlong lines are skipped (the text report counts them)."""
    for _, record in iter_jsonl(path, _Uncounted(), root):
        yield record


class _Uncounted(list):
    """A skipped-lines sink that keeps nothing: a hostile file cannot grow it."""

    def append(self, _item: object) -> None:
        pass


def _trim(event: dict[str, Any]) -> dict[str, Any]:
    keep = ("event", "time", "step", "rank", "alert", "action", "reason", "blocking_seconds",
            "write_seconds", "restart_count", "error")
    return {k: event[k] for k in keep if k in event}


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None
