"""Straggler detection from the timing the ranks publish: their own, and the job's summary.

Each timing window gives, per rank, its mean per-step *local* time (time outside
collective phases: what the rank's own speed decides; ``compute + data_wait`` for
ranks that do not publish it), and a constant-size summary of the whole job's
(``trainwatch.contract.timing``).  Scores are robust: ``ratio`` = local time over the
median of the other ranks, ``score`` = (local - median) / (1.4826 x MAD).  A rank is
flagged after ``windows`` consecutive slow windows and clears after ``clear_windows``
normal ones.  Work per window is O(local ranks), whatever the world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from trainwatch.contract.timing import median_sorted, median_without, valid_summary

MAD_SCALE = 1.4826   # MAD -> standard deviation for normal data
NOISE_FLOOR = 0.02   # spreads below 2 % of the median are noise, not signal


@dataclass
class Scores:
    median: float
    mad: float
    ratio: dict[int, float]
    score: dict[int, float]


def score(summary: dict[str, Any], local: dict[int, float]) -> Scores:
    """Robust scores of some ranks against the job; ratio uses the median of the *other*
    ranks (works for 2), read from the summary's middle values."""
    median, mad = float(summary["median"]), float(summary["mad"])
    spread = max(MAD_SCALE * mad, NOISE_FLOOR * abs(median), 1e-12)
    ratios, scores = {}, {}
    for rank, value in local.items():
        other = median_without(summary, [value])
        if other is None:  # alone in the job, or not in this window: compare with all
            other = median if summary["ranks"] > 1 else value
        ratios[rank] = value / other if other > 0 else 1.0
        scores[rank] = (value - median) / spread
    return Scores(median, mad, ratios, scores)


@dataclass
class _RankTrack:
    """A rank's current streak, counted in steps so sparse sampling cannot slow detection.

    The agent may see only some of the windows (fast steps, a 1 s collection
    interval); a streak spans from the first step of its first slow window to the last
    step of the latest one, and ``windows`` consecutive windows means that many
    windows' worth of steps, every observed window slow.
    """

    slow_windows: int = 0
    streak_from: int | None = None      # first step of the current slow / normal streak
    normal_from: int | None = None
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

    def is_slow(self, ratio: float, z: float, world: int) -> bool:
        if ratio < float(self.options["ratio"]):
            return False
        return world < int(self.options["min_ranks_for_score"]) or z >= float(self.options["score"])

    def _advance(self, track: _RankTrack, slow: bool, when: float, step: int,
                 window_steps: int) -> None:
        first = step - window_steps + 1
        if slow:
            track.normal_from = None
            if track.streak_from is None:
                track.streak_from, track.since = first, when
            span = step - track.streak_from + 1
            track.slow_windows = max(1, span // window_steps)
            if not track.active and track.slow_windows >= int(self.options["windows"]):
                track.active, track.detected_at, track.detected_step = True, when, step
                track.since_step = track.streak_from
            return
        track.streak_from, track.slow_windows = None, 0
        if track.normal_from is None:
            track.normal_from = first
        normal = (step - track.normal_from + 1) // window_steps
        if track.active and normal < int(self.options["clear_windows"]):
            return
        track.active, track.since, track.since_step = False, None, None
        track.detected_at = track.detected_step = None

    def update(self, window: dict[str, Any], local_ranks: Sequence[int], now: float) -> bool:
        """Score a new window (``job_window``); False if already seen or unusable."""
        key = (window.get("step"), window.get("time"))
        if key == self.last_window or not isinstance(window.get("step"), int):
            return False
        summary, local = window.get("job"), window.get("local") or {}
        if not valid_summary(summary):
            return False
        self.last_window = key
        step = window["step"]
        window_steps = max(1, int(window.get("window_steps") or 1))
        mine = {r: local[r] for r in set(local_ranks) if r in local}
        scores = score(summary, mine)
        self.last_scores = scores
        world = summary["ranks"]
        for rank, ratio in scores.ratio.items():
            track = self.ranks.setdefault(rank, _RankTrack())
            slow = self.is_slow(ratio, scores.score[rank], world)
            self._advance(track, slow, now, step, window_steps)
        others = median_without(summary, mine.values()) if mine else None
        if others is not None and len(mine) < world:
            self.node_ratio = median_sorted(sorted(mine.values())) / max(others, 1e-12)
            self._advance(self.node, self.node_ratio >= float(self.options["ratio"]), now,
                          step, window_steps)
        else:
            self.node_ratio = None
        return True
