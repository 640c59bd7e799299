"""The job-wide timing summary a rank's status carries: constant size at any world size.

Every ``exchange_every`` steps the ranks exchange their mean per-step *local* time
(time outside collective phases). Each rank's status keeps only its own means plus a
summary of the job's distribution: the count, median, MAD, extremes and the sorted values
around the median (``middle``, starting at index ``middle_from`` of the sorted list).
That middle is enough to compute exactly the median of the job *without* any few ranks
(up to about half its width): the "median of the other ranks" straggler scoring compares a
rank, or a node's ranks, against. Readers parse O(1) per rank, never O(world).

A rank also keeps its own standing in its last ``RECENT_WINDOWS`` windows (``recent``:
step, ratio to the median of the other ranks, robust z-score), computed as a reader
would from each window's summary: windows come faster than an agent looks (5 steps of
65 ms are a third of its 1 s collection), and a verdict over every window, not every
third, follows a slowdown in steps rather than in agent polls.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Iterable, Sequence, TypeGuard

MIDDLE_HALF_WIDTH = 9   # default; writers widen it to the local world size (ranks per node)
MIDDLE_HALF_WIDTH_MAX = 65
RECENT_WINDOWS = 8      # a rank's own standing in its last windows (``recent``)
MAD_SCALE = 1.4826      # MAD -> standard deviation for normal data
NOISE_FLOOR = 0.02      # spreads below 2 % of the median are noise, not signal


def median_sorted(values: Sequence[float]) -> float:
    n = len(values)
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2.0


VECTOR_FROM = 256  # ranks from which ``summarize`` selects with numpy instead of sorting


def summarize(values: Sequence[float], half_width: int = MIDDLE_HALF_WIDTH) -> dict[str, Any]:
    """The summary of one window's per-rank local seconds (index = rank): a list, or for
    a large job a numpy array (selected in linear time: the same summary, exactly)."""
    n = len(values)
    if n >= VECTOR_FROM:
        return _summarize_selecting(values, half_width)
    values = values if isinstance(values, list) else [float(v) for v in values]
    ordered = sorted(values)
    median = median_sorted(ordered)
    mad = median_sorted(sorted(abs(v - median) for v in values))
    half = max(1, min(int(half_width), MIDDLE_HALF_WIDTH_MAX))
    start = max(0, (n - 1) // 2 - half)
    stop = min(n, n // 2 + half + 1)
    slowest = max(range(n), key=values.__getitem__)
    return {"ranks": n, "median": median, "mad": mad, "min": ordered[0],
            "max": ordered[-1], "slowest_rank": slowest,
            "middle_from": start, "middle": ordered[start:stop]}


def _summarize_selecting(values: Sequence[float], half_width: int) -> dict[str, Any]:
    """``summarize`` by selection (``numpy.partition``) rather than a sort: linear in the
    ranks and in C, ~30x faster at 32k ranks. Only the order statistics the summary holds
    are placed; their values, and so every number of the summary, are those of a sort."""
    import numpy as np  # here: readers of the contract (the agent) need not load it

    v = np.asarray(values, dtype=np.float64)
    n = int(v.size)
    half = max(1, min(int(half_width), MIDDLE_HALF_WIDTH_MAX))
    start = max(0, (n - 1) // 2 - half)
    stop = min(n, n // 2 + half + 1)
    middle = np.sort(np.partition(v, [start, stop - 1])[start:stop])  # holds the median
    median = median_sorted(middle[(n - 1) // 2 - start:n // 2 - start + 1].tolist()) \
        if n % 2 == 0 else float(middle[n // 2 - start])
    mid = n // 2
    deviations = np.partition(np.abs(v - median), [mid - 1, mid] if n % 2 == 0 else [mid])
    mad = float(deviations[mid]) if n % 2 else (float(deviations[mid - 1])
                                                  + float(deviations[mid])) / 2.0
    return {"ranks": n, "median": median, "mad": mad, "min": float(v.min()),
            "max": float(v.max()), "slowest_rank": int(np.argmax(v)),
            "middle_from": start, "middle": middle.tolist()}


def valid_summary(summary: Any) -> TypeGuard[dict[str, Any]]:
    """True for a summary a reader can use (any bytes may be in a status file)."""
    if not isinstance(summary, dict):
        return False
    n, start, middle = summary.get("ranks"), summary.get("middle_from"), summary.get("middle")
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1
            and isinstance(start, int) and not isinstance(start, bool) and start >= 0
            and isinstance(middle, list) and middle and start + len(middle) <= n):
        return False
    numbers = [summary.get("median"), summary.get("mad"), *middle]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in numbers) and all(a <= b for a, b in zip(middle, middle[1:]))


def median_without(summary: dict[str, Any], removed: Iterable[float]) -> float | None:
    """Median of the job's values with ``removed`` (values that are in it) taken out.

    None when nothing is left, when the removed values are not in the summarized window,
    or when too many were removed for the middle to still hold the median.
    """
    n, start = summary["ranks"], summary["middle_from"]
    window = list(summary["middle"])
    below = above = 0
    for value in removed:
        if not window:
            return None
        if value < window[0]:
            below += 1
        elif value > window[-1]:
            above += 1
        else:
            i = bisect.bisect_left(window, value)
            if i >= len(window) or window[i] != value:
                return None  # not a value of this window
            del window[i]
    left = n - below - above - (len(summary["middle"]) - len(window))
    if left <= 0 or below > start or above > n - start - len(summary["middle"]):
        return None
    offset = start - below  # values left below the (reduced) window
    lo, hi = (left - 1) // 2 - offset, left // 2 - offset
    if lo < 0 or hi >= len(window):
        return None
    return (window[lo] + window[hi]) / 2.0


def standing(summary: dict[str, Any], value: float) -> tuple[float, float]:
    """One rank's ``(ratio, z)`` in a window: its local seconds over the median of the
    *other* ranks (works for 2), and its robust z-score against the job."""
    median, mad = float(summary["median"]), float(summary["mad"])
    spread = max(MAD_SCALE * mad, NOISE_FLOOR * abs(median), 1e-12)
    other = median_without(summary, [value])
    if other is None:  # alone in the job, or not in this window: compare with all
        other = median if summary["ranks"] > 1 else value
    return (value / other if other > 0 else 1.0), (value - median) / spread


def recent_standing(timing: Any, limit: int = 2 * RECENT_WINDOWS) -> list[tuple[int, float, float]]:
    """A status ``timing``'s ``recent`` as ``(step, ratio, z)`` in step order; entries that
    are not three finite numbers with an integer step are skipped (any bytes may be there)."""
    entries = timing.get("recent") if isinstance(timing, dict) else None
    if not isinstance(entries, list):
        return []
    usable = []
    for entry in entries[-limit:]:
        if not (isinstance(entry, list) and len(entry) == 3):
            continue
        step, ratio, z = entry[0], _finite(entry[1]), _finite(entry[2])
        if isinstance(step, int) and not isinstance(step, bool) and ratio is not None \
                and ratio > 0 and z is not None:
            usable.append((step, ratio, z))
    return sorted(usable)


def own_local_seconds(timing: Any) -> float | None:
    """A rank's own mean local seconds from its status ``timing``, or None if unusable."""
    if not isinstance(timing, dict):
        return None
    local = _finite(timing.get("local_seconds"))
    if local is None:
        compute = _finite(timing.get("compute_seconds"))
        if compute is None:
            return None
        local = compute + (_finite(timing.get("data_wait_seconds")) or 0.0)
    return local


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def job_window(timings: dict[int, Any]) -> dict[str, Any] | None:
    """The newest usable window among some ranks' status ``timing`` (index = rank).

    ``{"step", "window_steps", "time", "job": summary, "local": {rank: seconds},
    "data_wait": {rank: seconds}, "recent": {rank: [(step, ratio, z), ...]}}``, with the
    values of the ranks that published that same window; None if none carries a usable
    job summary.
    """
    checked: list[dict[str, Any]] = []  # every rank carries the same summary: check it once

    def valid_once(summary: Any) -> bool:
        if any(summary == seen for seen in checked):
            return True
        if valid_summary(summary):
            checked.append(summary)
            return True
        return False

    usable = {r: t for r, t in timings.items() if isinstance(t, dict)
              and isinstance(t.get("step"), int) and not isinstance(t.get("step"), bool)
              and own_local_seconds(t) is not None and valid_once(t.get("job"))}
    if not usable:
        return None
    newest = max(usable.values(), key=lambda t: (t["step"], _finite(t.get("time")) or 0.0))
    # A window is its last step; each rank stamps its own start ``time`` on it.
    same = {r: t for r, t in usable.items() if t["step"] == newest["step"]}
    return {"step": newest["step"], "window_steps": newest.get("window_steps"),
            "time": newest.get("time"), "job": newest["job"],
            "local": {r: own_local_seconds(t) for r, t in same.items()},
            "data_wait": {r: _finite(t.get("data_wait_seconds")) or 0.0
                          for r, t in same.items()},
            "recent": {r: recent_standing(t) for r, t in same.items()}}
