"""A rank's timing windows: the asynchronous all-reduce of each window's sketch and the
summary the status carries as ``timing``.

Every ``exchange_every`` steps the loop hands over its window's means (own compute, data
wait and local seconds). One all-reduce of a fixed-size sketch of every rank's means
(``timing_exchange``) is started asynchronously and picked up by whoever sees it done
first: the heartbeat thread, or the loop at the next exchange (then long finished, as
every rank started it at the same step), so the loop never waits for the round trip. The
heartbeat thread turns it into the rank's own means plus a constant-size job summary
(``trainwatch.contract.timing``): neither the bytes exchanged nor the work nor the status
file grows with the world size.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, ContextManager

from trainwatch.contract.timing import MIDDLE_HALF_WIDTH, RECENT_WINDOWS, standing
from trainwatch.rank import timing_exchange


class WindowExchange:
    """The exchange group, the window in flight and the completed windows of one rank.

    Handed the live status dict and its lock (it sets ``backend`` and ``timing``), and how
    to mark the loop's time in the exchange (a ``telemetry_exchange`` phase).
    """

    def __init__(self, rank: int, state: dict[str, Any], lock: threading.Lock,
                 phase: Callable[[str], ContextManager[Any]]):
        self.rank, self.state, self.lock, self.phase = rank, state, lock, phase
        self.group: Any = None
        # (works, sketch, own means, step, window steps, time) of the last all-reduce
        # until someone publishes it; guarded by the lock.
        self.in_flight: tuple | None = None
        # (step, window steps, time, own means, summed sketch) of the completed exchanges,
        # newest last, until the heartbeat thread summarizes them; guarded by the lock.
        self.windows: collections.deque = collections.deque(maxlen=RECENT_WINDOWS)
        # This rank's (step, ratio, z) in its last windows: the status's timing.recent.
        self.recent: collections.deque = collections.deque(maxlen=RECENT_WINDOWS)
        # The job summary keeps enough values around the median to leave out every rank
        # of one node (an agent compares its node with the rest).
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
        self.middle_half_width = max(MIDDLE_HALF_WIDTH,
                                     int(local_world) if local_world.isdigit() else 0)

    def join(self, exchange_every: int) -> None:
        """Note the process group's backend; with an exchange and more than one rank, take
        the group the exchange runs in (created collectively: every rank calls this)."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return
        backend = dist.get_backend()
        with self.lock:
            self.state["backend"] = backend
        if exchange_every and dist.get_world_size() > 1:
            # A CPU (gloo) side group: the exchange never touches the GPU stream and never
            # shows up in the training process group's collective sequence.
            self.group = (dist.group.WORLD if backend == "gloo"
                          else dist.new_group(backend="gloo"))

    def release(self) -> None:
        """Let go of the process group: a Telemetry that outlives destroy_process_group (a
        module-level global) must not keep gloo's worker threads running into shutdown."""
        self.group = None

    def exchange(self, step: int, n: int, mine: list[float]) -> None:
        """Start the all-reduce of a full window (``n`` steps ending at ``step``, this rank's
        mean compute, data wait and local seconds), after collecting the one before."""
        sketch = timing_exchange.local_sketch(self.rank, mine[2])
        if self.group is None:  # alone: the sum of one sketch is itself
            self.keep(step, n, time.time(), mine, sketch)
            return
        import torch.distributed as dist
        with self.phase("telemetry_exchange"):
            self.collect(wait=True)
            works = timing_exchange.start(dist, self.group, sketch)
            with self.lock:
                self.in_flight = (works, sketch, mine, step, n, time.time())

    def collect(self, wait: bool) -> None:
        """Keep the in-flight exchange if it is done (or, with ``wait``, once it is)."""
        with self.lock:
            in_flight = self.in_flight
            if in_flight is None or not (wait or all(w.is_completed() for w in in_flight[0])):
                return
            self.in_flight = None
        works, sketch, mine, step, n, started = in_flight
        for work in works:
            work.wait()
        self.keep(step, n, started, mine, sketch)

    def keep(self, step: int, n: int, started: float, own: list[float],
             sketch: timing_exchange.Sketch) -> None:
        """Queue a completed window (own compute, data wait and local seconds; the job's
        summed sketch) for the heartbeat thread to summarize: O(1) here."""
        with self.lock:
            if not self.windows or self.windows[-1][0] < step:  # never behind a newer one
                self.windows.append((step, n, started, own, sketch))

    def summarize(self) -> None:
        """Publish the newest exchanged window as ``timing`` (own means + job summary),
        with this rank's standing in every window since the last beat as ``recent``."""
        with self.lock:
            pending = list(self.windows)
            self.windows.clear()
        timing = None
        for step, n, started, own, sketch in pending:
            if self.recent and self.recent[-1][0] >= step:
                continue  # an exchange that completed after a newer one was published
            job = timing_exchange.job_summary(sketch, self.middle_half_width)
            ratio, z = standing(job, own[2])
            self.recent.append([step, round(ratio, 4), round(z, 3)])
            timing = {"step": step, "window_steps": n, "time": started,
                      "compute_seconds": own[0], "data_wait_seconds": own[1],
                      "local_seconds": own[2], "job": job}
        if timing is None:
            return
        timing["recent"] = list(self.recent)
        with self.lock:
            current = self.state["timing"]
            if current is None or current["step"] < timing["step"]:
                self.state["timing"] = timing
