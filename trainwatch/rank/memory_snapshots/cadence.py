"""How often a rank snapshots: every step, or the smallest K that keeps the snapshots'
cost to the loop under 1 % of step time.

The cost to the loop is what it waits for (the copy to host memory, starting the writer,
and, when the previous write is still running, that write) and what the writer thread takes
from it holding the GIL (its CPU outside the calls that release the GIL: building and
pickling the payload's index, payload.py). Against the step time measured between
snapshots (the writer's GIL time taken out of it), that gives K = ceil(cost / (1 % of a
step)). ``every_step`` pins K at 1 whatever it costs; ``auto`` starts at 1 and moves K from
the median of the last few measurements. All ranks must snapshot the same steps (their
snapshots are compared at a resume), so each rank proposes its K and the ranks take the
largest (snapshotter.py).

A snapshot helps a restart only when it is newer than the durable checkpoint: with K at or
above the durable checkpoint's interval it mostly is not, and ``why`` says so (the status's
``cadence``, the journal's ``memory_snapshots_cadence``) instead of snapshotting silently.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

BUDGET = 0.01        # of step time
MAX_EVERY = 1000     # K never grows past this: a snapshot every 1000 steps is still one
WINDOW = 5           # measurements the median is taken over

EVERY_STEP, EVERY_K, NOT_BELOW_DURABLE = "every_step", "every_k", "not_below_durable"


class Cadence:
    def __init__(self, mode: str, budget: float = BUDGET, durable_every: int = 0):
        self.mode = mode
        self.budget = budget
        self.durable_every = durable_every  # the durable checkpoint's interval (0: none)
        self._waits: deque[float] = deque(maxlen=WINDOW)
        self._writer: deque[float] = deque(maxlen=WINDOW)
        self._steps: deque[float] = deque(maxlen=WINDOW)

    def note(self, wait_seconds: float, steps: int, seconds: float,
             writer_seconds: float = 0.0) -> None:
        """One snapshot's wait of the loop, the previous snapshot's writer GIL time, and
        ``steps`` steps that took ``seconds`` since the previous snapshot (its wait
        excluded; the writer's GIL time is taken out: it is the snapshot's, not the step's)."""
        self._waits.append(max(0.0, wait_seconds))
        self._writer.append(max(0.0, writer_seconds))
        if steps > 0 and seconds > 0:
            self._steps.append(max(seconds - writer_seconds, seconds / 2) / steps)

    def cost(self) -> float | None:
        """The median seconds a snapshot costs the loop (wait + writer GIL), None before any."""
        if not self._waits:
            return None
        return median(w + g for w, g in zip(self._waits, self._writer))

    def every(self) -> int:
        """The K this rank proposes."""
        if self.mode == "every_step":
            return 1
        cost = self.cost()
        if cost is None or not self._steps:
            return 1
        step = median(self._steps)
        if step <= 0:
            return MAX_EVERY
        return max(1, min(MAX_EVERY, math.ceil(cost / (self.budget * step))))

    def overhead(self, every: int) -> float | None:
        """The measured cost as a share of step time at K = ``every`` (None before any)."""
        cost = self.cost()
        if cost is None or not self._steps or median(self._steps) <= 0:
            return None
        return cost / (median(self._steps) * every)

    def verdict(self, every: int) -> str:
        """``every_step``, ``every_k`` (below the durable interval) or ``not_below_durable``."""
        if every <= 1:
            return EVERY_STEP
        if self.durable_every > 0 and every >= self.durable_every:
            return NOT_BELOW_DURABLE
        return EVERY_K

    def why(self, every: int) -> str:
        """What the status says about the agreed K."""
        share = self.overhead(every)
        measured = "" if share is None else (
            f" (measured cost {share:.2%} of step time: the loop's wait "
            f"{median(self._waits) * 1e3:.1f} ms, the writer's GIL "
            f"{median(self._writer) * 1e3:.1f} ms a snapshot)")
        if self.mode == "every_step":
            text = "every step (memory_snapshots: every_step)" + measured
        elif every == 1:
            text = "every step: its cost is within 1 % of step time" + measured
        else:
            text = (f"every {every} steps: the smallest K keeping the cost within 1 % of "
                    "step time" + measured)
        if self.verdict(every) == NOT_BELOW_DURABLE:
            text += (f"; not below the durable checkpoint's interval ({self.durable_every} "
                     "steps): a snapshot is rarely newer than the durable checkpoint, so a "
                     "restart mostly loses what it would without snapshots (set "
                     "memory_snapshots: every_step to pay for one step, or off)")
        return text
