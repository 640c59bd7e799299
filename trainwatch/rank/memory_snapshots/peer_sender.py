"""A rank's background sender: its newest sealed snapshot, pushed to the ranks that hold it.

``offer(snapshot)`` is all the training loop does: it swaps the newest snapshot into a slot
under a lock and returns. The sender's thread pushes the newest one to each holder; one
that arrives while a push is under way waits for it, and any in between are skipped (only
the newest matters). A holder that fails (dead, unreachable, full) is retried with the next
snapshot after a back-off that doubles up to ``max_backoff`` seconds, so a dead node costs a
connect timeout now and then, never the loop's time. ``stats()``: per holder, the newest
step it stored and the last failure; counts of outcomes, ``dropped`` the offers replaced
before they went (a link slower than the steps). ``kind``: ``COPY`` for snapshots,
``PART`` for a rank's per-step part (rank_parts.py, a few KB every step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from trainwatch.rank.memory_snapshots import peer_wire as wire
from trainwatch.rank.memory_snapshots.peer_store import SnapshotFile

log = logging.getLogger(__name__)


@dataclass
class HolderState:
    endpoint: wire.Endpoint
    stored_step: int | None = None
    last_error: str = ""
    failures: int = 0          # in a row
    retry_at: float = 0.0      # monotonic


class PeerSender:
    def __init__(self, rank: int, holders: list[wire.Endpoint], secret: bytes, *,
                 timeout: float = 10.0, max_backoff: float = 30.0, kind: str = wire.COPY):
        self.rank, self._secret, self.timeout, self.max_backoff = rank, secret, timeout, max_backoff
        self.kind = kind
        self.holders = [HolderState(e) for e in holders]
        self._cond = threading.Condition()
        self._newest: SnapshotFile | None = None
        self._sent_step: int | None = None
        self._taken: SnapshotFile | None = None   # the one being pushed
        self._busy = False
        self._stop = False
        self.counts: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"trainwatch-peer-sender-{rank}")

    def __repr__(self) -> str:  # never the secret
        return f"PeerSender(rank={self.rank}, holders={[h.endpoint.rank for h in self.holders]})"

    def start(self) -> "PeerSender":
        if self.holders:
            self._thread.start()
        return self

    def offer(self, snapshot: SnapshotFile) -> None:
        """The rank's newest sealed snapshot; returns at once."""
        with self._cond:
            waiting = self._newest
            if waiting is not None and waiting is not self._taken and \
                    waiting.step != self._sent_step:
                self.counts["dropped"] += 1  # never sent: the link is slower than the steps
            self._newest = snapshot
            self._cond.notify()

    def wait_sent(self, step: int, timeout: float) -> bool:
        """Wait until the sender has tried every holder with ``step`` or later (tests and
        the end of a run); whether it did within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._busy and self._sent_step is not None and self._sent_step >= step,
                timeout)

    def stats(self) -> dict[str, object]:
        with self._cond:
            return {"counts": dict(self.counts),
                    "holders": {h.endpoint.rank: {"stored_step": h.stored_step,
                                                  "last_error": h.last_error}
                                for h in self.holders}}

    def close(self, timeout: float | None = None) -> None:
        """Stop; a push under way ends within the socket timeout."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(self.timeout * 2 if timeout is None else timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or (
                    self._newest is not None and self._newest.step != self._sent_step))
                if self._stop:
                    return
                snapshot = self._taken = self._newest
                self._busy = True
            assert snapshot is not None
            for holder in self.holders:
                self._push(holder, snapshot)
            with self._cond:
                self._sent_step, self._busy = snapshot.step, False
                self._cond.notify_all()

    def _push(self, holder: HolderState, snapshot: SnapshotFile) -> None:
        if not snapshot.path.exists():  # a part pruned before it went: the next one goes
            self._record(holder, snapshot, "changed", "")
            return
        if time.monotonic() < holder.retry_at:
            self._record(holder, snapshot, "backing_off", holder.last_error)
            return
        header = {"kind": self.kind, "from_rank": self.rank, "to_rank": holder.endpoint.rank,
                  "rank": snapshot.rank, "step": snapshot.step,
                  "world_size": snapshot.world_size, "digest": snapshot.digest}
        try:
            outcome = wire.push_file(holder.endpoint, self._secret, header, snapshot.path,
                                     self.timeout)
            error = "" if outcome == "stored" else f"holder answered {outcome}"
        except wire.FileChanged as exc:  # the snapshotter's doing: the next one goes
            outcome, error = "changed", str(exc)
        except (wire.WireError, OSError) as exc:
            outcome, error = "failed", str(exc)
        self._record(holder, snapshot, outcome, error)

    def _record(self, holder: HolderState, snapshot: SnapshotFile, outcome: str,
                error: str) -> None:
        with self._cond:
            self.counts[outcome] += 1
            if outcome == "stored":
                holder.stored_step, holder.last_error, holder.failures = snapshot.step, "", 0
                return
            if outcome in ("backing_off", "changed"):
                return
            holder.last_error = error
            holder.failures += 1
            if outcome in ("failed", "full", "busy"):
                holder.retry_at = time.monotonic() + min(
                    self.max_backoff, 0.5 * 2 ** (holder.failures - 1))
        if holder.failures == 1:  # the first of a run: later ones are in the counts
            log.warning("peer copy of rank %d step %d to rank %d not stored: %s",
                        snapshot.rank, snapshot.step, holder.endpoint.rank, error)
