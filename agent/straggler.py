"""Straggler detection from the job-wide timing distribution the ranks publish.

Each timing window gives, per rank, its mean per-step *local* time (time outside
collective phases: what the rank's own speed decides; ``compute + data_wait`` for
ranks that do not publish it).  Scores are robust: ``ratio`` = local time over the
median of the other ranks, ``score`` = (local - median) / (1.4826 x MAD).  A rank is
flagged after ``windows`` consecutive slow windows and clears after ``clear_windows``
normal ones.  Pure Python on purpose: scoring 4096 ranks takes a few milliseconds and
the agent stays small (no numpy).
"""

from __future__ import annotations

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


def local_times(timing: dict[str, Any]) -> list[float] | None:
    """Per-rank local seconds of one timing window, or None if the window is unusable."""
    local = timing.get("local_seconds")
    if not _floats(local):
        compute, data = timing.get("compute_seconds"), timing.get("data_wait_seconds")
        if not _floats(compute):
            return None
        data = data if _floats(data) and len(data) == len(compute) else [0.0] * len(compute)
        local = [c + d for c, d in zip(compute, data)]
    return [float(v) for v in local]


def _floats(values: Any) -> bool:
    return isinstance(values, list) and bool(values) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v == v for v in values)


def _median_sorted(values: Sequence[float]) -> float:
    n = len(values)
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2.0


def score(values: Sequence[float]) -> Scores:
    """Robust per-rank scores; ratio uses the median of the *other* ranks (works for 2)."""
    n = len(values)
    ordered = sorted(values)
    median = _median_sorted(ordered)
    mad = _median_sorted(sorted(abs(v - median) for v in values))
    spread = max(MAD_SCALE * mad, NOISE_FLOOR * abs(median), 1e-12)
    position = {}
    for i, v in enumerate(ordered):
        position.setdefault(v, i)
    ratios, scores = [], []
    for v in values:
        if n == 1:
            others = v
        else:  # median of the list with one copy of v removed, from the sorted list
            i = position[v]
            rest_n, mid = n - 1, (n - 1) // 2

            def at(j: int) -> float:
                return ordered[j] if j < i else ordered[j + 1]
            others = at(mid) if rest_n % 2 else (at(mid - 1) + at(mid)) / 2.0
        ratios.append(v / others if others > 0 else 1.0)
        scores.append((v - median) / spread)
    return Scores(median, mad, ratios, scores)


@dataclass
class _RankTrack:
    slow_windows: int = 0
    normal_windows: int = 0
    active: bool = False
    since: float | None = None
    detected_at: float | None = None


@dataclass
class JobStragglers:
    """Tracks one job's windows; fed once per new timing window."""

    options: dict[str, Any]
    last_window: tuple | None = None
    ranks: dict[int, _RankTrack] = field(default_factory=dict)
    node: _RankTrack = field(default_factory=_RankTrack)
    last_scores: Scores | None = None
    node_ratio: float | None = None

    def is_slow(self, ratio: float, z: float, world: int) -> bool:
        if ratio < float(self.options["ratio"]):
            return False
        return world < int(self.options["min_ranks_for_score"]) or z >= float(self.options["score"])

    def _advance(self, track: _RankTrack, slow: bool, when: float) -> None:
        if slow:
            track.slow_windows += 1
            track.normal_windows = 0
            if track.since is None:
                track.since = when
            if not track.active and track.slow_windows >= int(self.options["windows"]):
                track.active, track.detected_at = True, when
        else:
            track.normal_windows += 1
            track.slow_windows = 0
            if track.active and track.normal_windows < int(self.options["clear_windows"]):
                return
            track.active, track.since, track.detected_at = False, None, None

    def update(self, timing: dict[str, Any], local_ranks: Sequence[int], now: float) -> bool:
        """Score a new window; returns False if this window was already seen or unusable."""
        window = (timing.get("step"), timing.get("time"))
        if window == self.last_window:
            return False
        values = local_times(timing)
        if values is None:
            return False
        self.last_window = window
        scores = score(values)
        self.last_scores = scores
        world = len(values)
        for rank in local_ranks:
            if 0 <= rank < world:
                track = self.ranks.setdefault(rank, _RankTrack())
                self._advance(track, self.is_slow(scores.ratio[rank], scores.score[rank], world),
                              now)
        mine = sorted(values[r] for r in local_ranks if 0 <= r < world)
        others = sorted(v for r, v in enumerate(values) if r not in set(local_ranks))
        if mine and others:
            self.node_ratio = _median_sorted(mine) / max(_median_sorted(others), 1e-12)
            self._advance(self.node, self.node_ratio >= float(self.options["ratio"]), now)
        else:
            self.node_ratio = None
        return True
