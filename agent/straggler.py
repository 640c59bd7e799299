"""Straggler detection from the job-wide timing distribution the ranks publish.

Each timing window gives, per rank, its mean per-step *local* time (time outside
collective phases: what the rank's own speed decides; ``compute + data_wait`` for
ranks that do not publish it).  Scores are robust: ``ratio`` = local time over the
median of the other ranks, ``score`` = (local - median) / (1.4826 x MAD).  The verdict
follows the median of the last ``windows`` windows with hysteresis (flag at ``ratio``
when that is clear of the rank's own window-to-window noise, clear below
``clear_ratio``): a rank that stays slow stays flagged through noisy windows, and a
noisy machine raises the bar instead of the flag.  Worlds of 2-3 ranks have no spread to score against; there the ratio to the
other ranks' median alone decides (for two ranks: slower than the other one).  Pure Python on purpose: scoring 4096 ranks takes a few milliseconds and
the agent stays small (no numpy).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

MAD_SCALE = 1.4826   # MAD -> standard deviation for normal data
NOISE_FLOOR = 0.02   # spreads below 2 % of the median are noise, not signal


@dataclass
class Scores:
    median: float
    mad: float
    ratio: list[float]
    score: list[float]
    ordered: list[float]


def local_times(timing: dict[str, Any]) -> list[float] | None:
    """Per-rank local seconds of one timing window, or None if the window is unusable."""
    local = _floats(timing.get("local_seconds"))
    if local is None:
        compute = _floats(timing.get("compute_seconds"))
        if compute is None:
            return None
        data = _floats(timing.get("data_wait_seconds"))
        if data is None or len(data) != len(compute):
            data = [0.0] * len(compute)
        local = [c + d for c, d in zip(compute, data)]
    return local


def _floats(values: Any) -> list[float] | None:
    """The list as floats, or None unless it is a non-empty list of finite numbers."""
    if not isinstance(values, list) or not values:
        return None
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        return None
    total = sum(floats)
    return floats if total - total == 0 else None  # NaN or inf anywhere -> NaN


def _jitter(values: Sequence[float]) -> float | None:
    """Standard deviation of one value from successive differences (robust to level shifts)."""
    if len(values) < 4:
        return None
    diffs = sorted(abs(b - a) for a, b in zip(values, values[1:]))
    return MAD_SCALE * _median_sorted(diffs) / math.sqrt(2.0)


def _median_sorted(values: Sequence[float]) -> float:
    n = len(values)
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2.0


def score(values: Sequence[float]) -> Scores:
    """Robust per-rank scores; ratio uses the median of the *other* ranks (works for 2).

    The median without one value has only two or three possible values, picked by
    where that value sits in the sorted list: O(n log n) overall, no per-rank sort.
    """
    n = len(values)
    ordered = sorted(values)
    median = _median_sorted(ordered)
    mad = _median_sorted(sorted([abs(v - median) for v in values]))
    spread = max(MAD_SCALE * mad, NOISE_FLOOR * abs(median), 1e-12)
    if n == 1:
        others = [values[0]]
    else:
        rest, mid = n - 1, (n - 1) // 2
        if rest % 2:  # odd count left: one middle element
            low, high = ordered[mid + 1], ordered[mid]
            pivot = ordered[mid]
            others = [low if v <= pivot else high for v in values]
        elif mid == 0:  # n == 2: the other value itself
            others = [ordered[1] if v <= ordered[0] else ordered[0] for v in values]
        else:
            below = (ordered[mid] + ordered[mid + 1]) / 2.0     # v sits left of mid
            at_mid = (ordered[mid - 1] + ordered[mid + 1]) / 2.0
            above = (ordered[mid - 1] + ordered[mid]) / 2.0
            p1, p2 = ordered[mid - 1], ordered[mid]
            others = [below if v <= p1 else at_mid if v <= p2 else above for v in values]
    ratios = [v / o if o > 0 else 1.0 for v, o in zip(values, others)]
    scores = [(v - median) / spread for v in values]
    return Scores(median, mad, ratios, scores, ordered)


@dataclass
class _RankTrack:
    """One rank's (or node's) verdict: a smoothed level with hysteresis, counted in windows.

    ``level`` is the median log-ratio of the last ``windows`` observed windows, so one
    noisy window neither raises nor drops the flag.  ``noise`` is this rank's own
    window-to-window jitter (robust: the median absolute difference of successive
    log-ratios, which a lasting slowdown does not inflate).  The flag goes up when the
    level reaches ``ratio`` and stands ``noise_sigmas`` standard errors above 1 (and, in
    worlds of ``min_ranks_for_score`` or more, the median score reaches ``score``); it
    stays up until the level drops below ``clear_ratio``.
    """

    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (step, log ratio, z)
    level: float | None = None          # as a ratio (exp of the median log-ratio)
    noise: float | None = None          # standard deviation of one window's log-ratio
    slow_windows: int = 0
    streak_from: int | None = None      # first step of the current run of slow windows
    streak_since: float | None = None
    active: bool = False
    since: float | None = None
    since_step: int | None = None
    detected_at: float | None = None
    detected_step: int | None = None


@dataclass
class JobStragglers:
    """Tracks one job's windows; fed once per new timing window."""

    options: dict[str, Any]
    last_window: tuple | None = None
    ranks: dict[int, _RankTrack] = field(default_factory=dict)
    node: _RankTrack = field(default_factory=_RankTrack)
    last_scores: Scores | None = None
    node_ratio: float | None = None

    def _advance(self, track: _RankTrack, ratio: float, z: float | None, when: float,
                 step: int, window_steps: int) -> None:
        opts = self.options
        n = int(opts["windows"])
        enter, leave = math.log(float(opts["ratio"])), math.log(float(opts["clear_ratio"]))
        horizon = step - 64 * window_steps
        while track.recent and track.recent[0][0] < horizon:
            track.recent.popleft()  # an agent that missed a long stretch starts afresh
        track.recent.append((step, math.log(max(ratio, 1e-9)), z))
        values = [v for _, v, _ in track.recent]
        last = list(track.recent)[-n:]
        level = _median_sorted(sorted(v for _, v, _ in last))
        track.level = math.exp(level)
        track.noise = _jitter(values)
        if ratio >= float(opts["clear_ratio"]):
            if track.streak_from is None:
                track.streak_from, track.streak_since = step - window_steps + 1, when
            track.slow_windows += 1
        else:
            track.streak_from = track.streak_since = None
            track.slow_windows = 0
        if not track.active:
            scores = [v for _, _, v in last if v is not None]
            z_ok = not scores or _median_sorted(sorted(scores)) >= float(opts["score"])
            # The median of n windows varies by about 1.25 x noise / sqrt(n).
            # No verdict before the rank's noise is known (4 windows).
            if track.noise is not None and level >= enter and z_ok and \
                    level >= float(opts["noise_sigmas"]) * 1.2533 * track.noise / math.sqrt(
                        len(last)):
                track.active, track.detected_at, track.detected_step = True, when, step
                track.since = track.streak_since if track.streak_since is not None else when
                track.since_step = track.streak_from if track.streak_from is not None else step
        elif level < leave:
            track.active, track.since, track.since_step = False, None, None
            track.detected_at = track.detected_step = None

    def update(self, timing: dict[str, Any], local_ranks: Sequence[int], now: float) -> bool:
        """Score a new window; returns False if this window was already seen or unusable."""
        window = (timing.get("step"), timing.get("time"))
        if window == self.last_window or not isinstance(timing.get("step"), int):
            return False
        values = local_times(timing)
        if values is None:
            return False
        self.last_window = window
        step = timing["step"]
        window_steps = max(1, int(timing.get("window_steps") or 1))
        scores = score(values)
        self.last_scores = scores
        world = len(values)
        scored = world >= int(self.options["min_ranks_for_score"])
        for rank in local_ranks:
            if 0 <= rank < world:
                track = self.ranks.setdefault(rank, _RankTrack())
                self._advance(track, scores.ratio[rank], scores.score[rank] if scored else None,
                              now, step, window_steps)
        mine = sorted(values[r] for r in set(local_ranks) if 0 <= r < world)
        others = list(scores.ordered)  # everyone else: the sorted list minus this node's
        for v in mine:
            del others[bisect.bisect_left(others, v)]
        if mine and others:
            self.node_ratio = _median_sorted(mine) / max(_median_sorted(others), 1e-12)
            self._advance(self.node, self.node_ratio, None, now, step, window_steps)
        else:
            self.node_ratio = None
        return True
