"""How often a rank snapshots: every step, or the smallest K that keeps the loop's wait
under 1 % of step time.

The loop waits for a snapshot's copy to host memory (and, when the previous write is still
running, for that write); that wait, measured, against the step time, measured between
snapshots, gives K = ceil(wait / (1 % of K steps' time)). ``every_step`` pins K at 1 whatever
it costs; ``auto`` starts at 1 and moves K from the median of the last few measurements.
All ranks must snapshot the same steps (their snapshots are compared at a resume), so each
rank proposes its K and the ranks take the largest (snapshotter.py).
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

BUDGET = 0.01        # of step time
MAX_EVERY = 1000     # K never grows past this: a snapshot every 1000 steps is still one
WINDOW = 5           # measurements the median is taken over


class Cadence:
    def __init__(self, mode: str, budget: float = BUDGET):
        self.mode = mode
        self.budget = budget
        self._waits: deque[float] = deque(maxlen=WINDOW)
        self._steps: deque[float] = deque(maxlen=WINDOW)

    def note(self, wait_seconds: float, steps: int, seconds: float) -> None:
        """One snapshot's wait of the loop, and ``steps`` steps that took ``seconds`` since the
        previous snapshot (its wait excluded)."""
        self._waits.append(max(0.0, wait_seconds))
        if steps > 0 and seconds > 0:
            self._steps.append(seconds / steps)

    def every(self) -> int:
        """The K this rank proposes."""
        if self.mode == "every_step" or not self._waits or not self._steps:
            return 1
        wait, step = median(self._waits), median(self._steps)
        if step <= 0:
            return MAX_EVERY
        return max(1, min(MAX_EVERY, math.ceil(wait / (self.budget * step))))

    def overhead(self, every: int) -> float | None:
        """The measured wait as a share of step time at K = ``every`` (None before any)."""
        if not self._waits or not self._steps or median(self._steps) <= 0:
            return None
        return median(self._waits) / (median(self._steps) * every)

    def why(self, every: int) -> str:
        """What the status says about the agreed K."""
        share = self.overhead(every)
        measured = "" if share is None else f" (measured wait {share:.2%} of step time)"
        if self.mode == "every_step":
            return "every step (memory_snapshots: every_step)" + measured
        if every == 1:
            return "every step: its wait is within 1 % of step time" + measured
        return (f"every {every} steps: the smallest K keeping the wait within 1 % of step "
                "time" + measured)
