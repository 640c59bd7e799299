"""The job-wide timing summary a rank's status carries: constant size at any world size.

Every ``exchange_every`` steps the ranks sum a fixed-size *sketch* of their mean per-step
*local* time (time outside collective phases): per bin of ``SKETCH_BINS`` log-spaced bins,
each ``SKETCH_WIDTH`` wide in log seconds (0.5 %), how many ranks' values fall in it and
their sum (``trainwatch.rank.timing_exchange``), so a rank's work and bytes per window
do not depend on the world size. Each rank's status keeps its own means plus a summary
read off the summed sketch: the count, median, MAD, exact extremes and the sorted values
around the median (``middle``, starting at index ``middle_from`` of the sorted list), each
value the mean of its bin: exact for a value alone in its bin, else within the bin's
width (0.5 %) of the value it stands for (``sketch`` names the bins). That middle is
enough to compute the median of the job *without* any few ranks (up to about half its
width): the "median of the other ranks" straggler scoring compares a rank, or a node's
ranks, against; a reader takes a rank's own value out of its bin. Readers parse O(1) per
rank, never O(world). Summaries of exact values (no ``sketch``: ranks before the sketch)
read the same way, matching values exactly.

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
# The sketch: bin i holds local seconds in [LOW e^(i W), LOW e^((i+1) W)), from ~1 us to
# ~68 min (2^-20 to 2^12 s); values outside count in the first or last bin.
SKETCH_LOW = 2.0 ** -20
SKETCH_WIDTH = 0.005
SKETCH_BINS = 4437      # ceil(log(2^32) / SKETCH_WIDTH)
_INSIDE = 1e-7          # a bin's value is kept this far inside its edges (9 digits are kept)


def median_sorted(values: Sequence[float]) -> float:
    n = len(values)
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2.0


def sketch_bin(value: float, low: float = SKETCH_LOW, width: float = SKETCH_WIDTH,
               bins: int = SKETCH_BINS) -> int:
    """The bin a value counts in (the first for anything not above ``low``, NaN too; the
    last for anything past the last edge, infinity too)."""
    if not value > low:
        return 0
    place = math.log(value / low) / width
    return int(place) if place < bins - 1 else bins - 1


def sketch_edges(index: int, low: float = SKETCH_LOW, width: float = SKETCH_WIDTH,
                 bins: int = SKETCH_BINS) -> tuple[float, float]:
    """A bin's values lie in [first, second); the first and last bins are open-ended."""
    return (0.0 if index <= 0 else low * math.exp(index * width),
            math.inf if index >= bins - 1 else low * math.exp((index + 1) * width))


def _bin_value(index: int, mean: float) -> float:
    """The value a bin stands for: the mean of its values, kept inside the bin (a sum in
    float32 may stray), to 9 significant digits."""
    first, end = sketch_edges(index)
    inside = min(max(mean, first * (1 + _INSIDE)), end * (1 - _INSIDE))
    return float(f"{inside:.9g}")


def summarize_bins(bins: Sequence[tuple[int, int, float]], lowest: float, highest: float,
                   slowest_rank: int, half_width: int = MIDDLE_HALF_WIDTH) -> dict[str, Any]:
    """The summary of one window from its summed sketch: ``bins`` are the (index, count,
    sum of values) of the non-empty bins in increasing order, the extremes exact. Work
    grows with the non-empty bins up to the median and out to the MAD, never with the
    number of ranks; at most ``SKETCH_BINS``."""
    n = sum(count for _, count, _ in bins)
    half = max(1, min(int(half_width), MIDDLE_HALF_WIDTH_MAX))
    start = max(0, (n - 1) // 2 - half)
    stop = min(n, n // 2 + half + 1)
    middle: list[float] = []
    below = 0  # values in the bins before this one
    for index, count, total in bins:
        take = min(below + count, stop) - max(below, start)
        if take > 0:
            middle += [_bin_value(index, total / count)] * take
        below += count
        if below >= stop:
            break
    median = median_sorted(middle[(n - 1) // 2 - start:n // 2 - start + 1])
    return {"ranks": n, "median": median, "mad": _mad(bins, median, n),
            "min": float(lowest), "max": float(highest), "slowest_rank": int(slowest_rank),
            "middle_from": start, "middle": middle,
            "sketch": [SKETCH_LOW, SKETCH_WIDTH, SKETCH_BINS]}


def _mad(bins: Sequence[tuple[int, int, float]], median: float, n: int) -> float:
    """The median of the bins' distances to the median, weighted by their counts: walked
    outward from the median (bins' means increase with their index), so only the bins
    within the MAD are visited."""
    def mean(at: int) -> float:
        return bins[at][2] / bins[at][1]

    right = bisect.bisect_left(bins, (sketch_bin(median),))  # the first mean >= median
    while right < len(bins) and mean(right) < median:
        right += 1
    while right > 0 and mean(right - 1) >= median:
        right -= 1
    left, seen, picked = right - 1, 0, []
    wanted = {(n - 1) // 2, n // 2}  # the order statistics the MAD averages
    while seen <= n // 2:
        up = mean(right) - median if right < len(bins) else math.inf
        down = median - mean(left) if left >= 0 else math.inf
        if up <= down:
            deviation, count, right = up, bins[right][1], right + 1
        else:
            deviation, count, left = down, bins[left][1], left - 1
        picked += [deviation] * sum(1 for j in wanted if seen <= j < seen + count)
        seen += count
    return sum(picked) / len(picked)


def summarize(values: Sequence[float], half_width: int = MIDDLE_HALF_WIDTH) -> dict[str, Any]:
    """The summary the ranks publish when their local seconds are ``values`` (index =
    rank): what summing their sketches gives (simulations, tests)."""
    values = [float(v) for v in values]
    sums: dict[int, list[float]] = {}
    for v in values:
        entry = sums.setdefault(sketch_bin(v), [0, 0.0])
        entry[0] += 1
        entry[1] += v
    slowest = max(range(len(values)), key=values.__getitem__)
    return summarize_bins([(i, int(c), t) for i, (c, t) in sorted(sums.items())],
                          min(values), values[slowest], slowest, half_width)


def valid_summary(summary: Any) -> TypeGuard[dict[str, Any]]:
    """True for a summary a reader can use (any bytes may be in a status file)."""
    if not isinstance(summary, dict):
        return False
    n, start, middle = summary.get("ranks"), summary.get("middle_from"), summary.get("middle")
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1
            and isinstance(start, int) and not isinstance(start, bool) and start >= 0
            and isinstance(middle, list) and middle and start + len(middle) <= n):
        return False
    if "sketch" in summary and _sketch(summary) is None:
        return False
    numbers = [summary.get("median"), summary.get("mad"), *middle]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in numbers) and all(a <= b for a, b in zip(middle, middle[1:]))


def _sketch(summary: dict[str, Any]) -> tuple[float, float, int] | None:
    """A summary's bins as (low, width, count); None when absent or not usable."""
    sketch = summary.get("sketch")
    if not (isinstance(sketch, list) and len(sketch) == 3):
        return None
    low, width, bins = _finite(sketch[0]), _finite(sketch[1]), sketch[2]
    if low is None or width is None or not (0 < low < 1e3 and 0 < width <= 1) \
            or isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins \
            or bins * width > 690:  # its edges must stay finite
        return None
    return low, width, bins


def median_without(summary: dict[str, Any], removed: Iterable[float]) -> float | None:
    """Median of the job's values with ``removed`` (values that are in it) taken out: from
    a sketch, each out of its own bin (where it counted).

    None when nothing is left, when the removed values are not in the summarized window,
    or when too many were removed for the middle to still hold the median.
    """
    n, start = summary["ranks"], summary["middle_from"]
    window = list(summary["middle"])
    sketch = _sketch(summary)
    below = above = 0
    for value in removed:
        if not window:
            return None
        if sketch is None:  # exact values: only the value itself
            first, end = value, math.nextafter(value, math.inf)
        else:
            first, end = sketch_edges(sketch_bin(value, *sketch), *sketch)
        if end <= window[0]:
            below += 1
        elif first > window[-1]:
            above += 1
        else:
            i = bisect.bisect_left(window, first)
            if i >= len(window) or window[i] >= end:
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
    isfinite = math.isfinite
    for entry in entries[-limit:]:
        if type(entry) is list and len(entry) == 3:  # as written: a quick look (per rank,
            step, ratio, z = entry                    # every window, on the agent)
            if type(step) is int and type(ratio) is float and type(z) is float \
                    and isfinite(ratio) and isfinite(z) and ratio > 0:
                usable.append((step, ratio, z))
                continue
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
