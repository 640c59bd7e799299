"""Straggler detection from the timing the ranks publish: their own, and the job's summary.

Each timing window gives, per rank, its mean per-step *local* time (time outside
collective phases: what the rank's own speed decides; ``compute + data_wait`` for
ranks that do not publish it), and a constant-size summary of the whole job's
(``trainwatch.contract.timing``).  Scores are robust: ``ratio`` = local time over the
median of the other ranks, ``score`` = (local - median) / (1.4826 x MAD).  Shared
slowdowns cancel in the ratio.  The verdict accumulates evidence across windows (a
one-sided CUSUM of the log-ratio above ``clear_ratio``, in units of the rank's own
window-to-window noise) instead of needing k slow windows in a row: a clearly slow rank
on a steady machine is flagged after two windows, and a noisy machine raises the bar
(set for about one false flag in ``FALSE_FLAG_WINDOWS`` clean windows) instead of the
flag.  The flag clears on evidence the other way (below ``ratio``) once the median of
the last ``windows`` windows is below ``ratio``: one normal-looking window does not drop
it.  Worlds of 2-3 ranks have no spread
to score against; there the ratio to the other ranks' median alone decides (for two
ranks: slower than the other one).  Windows shorter than the agent's look are not lost:
each rank's status lists its standing in its last few windows (``recent``), and the
verdict takes those it has not seen.  Work per window is O(local ranks), whatever the
world size.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from trainwatch.contract.timing import (MAD_SCALE, NOISE_FLOOR, median_sorted, median_without,
                                        standing, valid_summary)

FALSE_FLAG_WINDOWS = 1e10  # a clean rank's windows per false flag the evidence bar aims at
VERDICT_WINDOWS = 8  # windows a rank's noise is measured over before any verdict
CLEAR_SHARE = 0.5  # clearing needs this share of the least evidence a flag needs


def evidence_needed(floor: float, drift: float) -> float:
    """The CUSUM threshold (in standard errors) with a false flag once in about
    ``FALSE_FLAG_WINDOWS`` windows of a clean rank, whose evidence drifts down by ``drift``
    per window (Siegmund's approximation of the average run length); at least ``floor``.
    Steady ranks (clear_ratio many standard errors away) need little; noisy ones more."""
    scale = 2.0 * drift * drift * FALSE_FLAG_WINDOWS
    if scale <= 1.0:
        return math.inf
    return max(floor, math.log(scale) / (2.0 * drift) - 1.166)


@dataclass
class Scores:
    median: float
    mad: float
    ratio: dict[int, float]
    score: dict[int, float]


def score(summary: dict[str, Any], local: dict[int, float]) -> Scores:
    """Robust scores of some ranks against the job; ratio uses the median of the *other*
    ranks (works for 2), read from the summary's middle values."""
    ratios, scores = {}, {}
    for rank, value in local.items():
        ratios[rank], scores[rank] = standing(summary, value)
    return Scores(float(summary["median"]), float(summary["mad"]), ratios, scores)


def _jitter(values: Sequence[float]) -> float | None:
    """Standard deviation of one value from successive differences (robust to level shifts)."""
    if len(values) < 4:
        return None
    diffs = sorted(abs(b - a) for a, b in zip(values, values[1:]))
    return MAD_SCALE * median_sorted(diffs) / math.sqrt(2.0)



@dataclass
class _RankTrack:
    """One rank's (or node's) verdict: evidence accumulated over windows, with hysteresis.

    ``noise`` is this rank's own window-to-window jitter (robust: the median absolute
    difference of successive log-ratios, which a lasting slowdown does not inflate).
    ``evidence`` adds each window's log-ratio above ``clear_ratio`` in those units (never
    below 0).  The flag goes up when it reaches ``evidence_needed`` (at least
    ``noise_sigmas``), the windows it came from average ``ratio`` or more, the level (the
    median of the last ``windows`` windows) is above ``clear_ratio`` and, in worlds of
    ``min_ranks_for_score`` or more, their median score reaches ``score``.  It clears when
    ``recovery`` (the same, below ``ratio``) reaches ``CLEAR_SHARE x noise_sigmas`` and the
    level is below ``ratio``.
    """

    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (step, log ratio, z)
    level: float | None = None          # as a ratio (exp of the median log-ratio)
    slow_windows: int = 0               # slow windows in the current run (see _advance)
    normal_run: int = 0                 # normal windows in a row since the last slow one
    streak_from: int | None = None      # first step of the current run of slow windows
    streak_since: float | None = None
    evidence: float = 0.0               # CUSUM of slowness, in standard errors (see _advance)
    recovery: float = 0.0               # ... and of being back to normal, once flagged
    run: tuple[float, int] = (0.0, 0)   # sum and count of log-ratios since evidence was 0
    active: bool = False
    since: float | None = None
    since_step: int | None = None
    detected_at: float | None = None
    detected_step: int | None = None
    cleared_step: int | None = None     # the window's last step when the flag last cleared

    @property
    def judging(self) -> bool:
        """Enough windows for a verdict: before ``VERDICT_WINDOWS``, no flag can go up."""
        return len(self.recent) >= VERDICT_WINDOWS

    @property
    def noise(self) -> float | None:
        """Standard deviation of one window's log-ratio (computed when a verdict needs it)."""
        return _jitter([v for _, v, _ in self.recent])


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
            track.evidence = track.recovery = 0.0
        x = math.log(max(ratio, 1e-9))
        track.recent.append((step, x, z))
        last = list(track.recent)[-n:]
        level = median_sorted(sorted(v for _, v, _ in last))
        track.level = math.exp(level)
        if ratio >= float(opts["clear_ratio"]):
            if track.streak_from is None:
                track.streak_from, track.streak_since = step - window_steps + 1, when
            track.slow_windows += 1
            track.normal_run = 0
        else:
            # One normal-looking window does not end a run of slow ones (a slow rank on a
            # loaded machine has them); two in a row do.
            track.normal_run += 1
            if track.normal_run >= 2:
                track.streak_from = track.streak_since = None
                track.slow_windows = 0
        noise = track.noise
        if noise is None or not track.judging:
            return  # no verdict yet: 4 windows' jitter is no measure of a rank's noise
        # Evidence in standard errors of this rank's own windows, accumulated (CUSUM):
        # each window adds how far its log-ratio stands above clear_ratio (below ratio,
        # for the way back); a run of slow windows adds up, a normal one takes away.
        sigma = max(noise, NOISE_FLOOR)
        track.evidence = max(0.0, track.evidence + (x - leave) / sigma)
        track.run = (track.run[0] + x, track.run[1] + 1) if track.evidence > 0 else (0.0, 0)
        track.recovery = max(0.0, track.recovery + (enter - x) / sigma)
        needed = evidence_needed(float(opts["noise_sigmas"]), leave / sigma)
        if not track.active:
            scores = [v for _, _, v in last if v is not None]
            z_ok = not scores or median_sorted(sorted(scores)) >= float(opts["score"])
            # The evidence's own windows must average a slowdown of ``ratio`` or more (a
            # long run of slightly slow windows is not a straggler), the level must be
            # above clear_ratio (hysteresis: never flagged below where it would clear).
            shift = track.run[0] / track.run[1] if track.run[1] else 0.0
            if track.evidence >= needed and shift >= enter and level >= leave and z_ok:
                track.active, track.detected_at, track.detected_step = True, when, step
                track.since = track.streak_since if track.streak_since is not None else when
                track.since_step = track.streak_from if track.streak_from is not None else step
                track.recovery, track.cleared_step = 0.0, None
        elif track.recovery >= CLEAR_SHARE * float(opts["noise_sigmas"]) and level < enter:
            track.active, track.since, track.since_step = False, None, None
            track.detected_at = track.detected_step = None
            track.evidence, track.cleared_step = 0.0, step

    def update(self, window: dict[str, Any], local_ranks: Sequence[int], now: float,
               node_ranks: Sequence[int] | None = None) -> bool:
        """Score a new window (``job_window``); False if already seen or unusable.

        ``local_ranks``: this node's running ranks, scored; ``node_ranks``: all of this
        node's ranks (default: the running ones). The node is compared with the others only
        while every one of its ranks is scored: a rank that finished first at a clean stop
        must not turn the node's median into one rank's."""
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
        scored = summary["ranks"] >= int(self.options["min_ranks_for_score"])
        world = summary["ranks"]
        recent = window.get("recent") or {}
        for rank, ratio in scores.ratio.items():
            track = self.ranks.setdefault(rank, _RankTrack())
            # Windows that came and went since the last look, as the rank scored them.
            seen = track.recent[-1][0] if track.recent else None
            if seen is not None and seen >= step:
                seen = None  # steps went back: a restart resumed from a checkpoint
            for old_step, old_ratio, old_z in recent.get(rank, ()):
                if old_step < step and (seen is None or old_step > seen):
                    self._advance(track, old_ratio, old_z if scored else None, now, old_step,
                                  window_steps)
            self._advance(track, ratio, scores.score[rank] if scored else None, now, step,
                          window_steps)
        others = median_without(summary, mine.values()) if mine else None
        whole = set(local_ranks if node_ranks is None else node_ranks) <= set(mine)
        if others is not None and len(mine) < world and whole:
            self.node_ratio = median_sorted(sorted(mine.values())) / max(others, 1e-12)
            self._advance(self.node, self.node_ratio, None, now, step, window_steps)
        else:
            self.node_ratio = None
        return True
