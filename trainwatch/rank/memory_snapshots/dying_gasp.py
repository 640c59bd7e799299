"""The dying gasp: a rank whose state is still that of the last completed step writes it.

With full snapshots every K steps, a restart would lose up to K steps. But when one rank
of a data-parallel job dies (killed, crashed), the others are stuck in the next step's
collective with the model and optimizer of step N, the last step every rank completed:
the same on every replica. So at teardown (the collective raising, the rank closing or
exiting on a failure) a rank whose state is still step N's writes it as a snapshot
(``<root>/gasp/rank-NNNNN/step-N.snap``, the store's format), and the restart takes the
model and optimizer from any replica's gasp and each rank's own RNGs and data position
from its part of step N (rank_parts.py): at most the step in flight is lost.

"Still step N's" is checked, never assumed: ``after_step(N)`` records the version counters
of the state's tensors (every in-place change bumps them: an optimizer step, a BatchNorm
buffer updated in a forward) and a global optimizer pre-step hook marks the state changed
under a lock the gasp holds while it reads, so a gasp from another thread never reads a
half-stepped state. The supervisor may also ask for it before it kills a frozen or hung
peer's job (``gasp_request.py``: the telemetry thread runs it while the loop waits in the
collective), and a SIGTERM that finds the loop blocked in C gets it from the wakeup fd's
reader (``gasp_on_term.py``). A gasp is bounded (``SECONDS``, within torchrun's 30 s
between SIGTERM and SIGKILL) and never raises: what it cannot do, it says (``memory_snapshot_gasp``).
Sharded (DTensor) state has no replicas: no gasp. One gasp per step: asked, then torn
down, the step is written once.
"""

from __future__ import annotations

import atexit
import copy
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainwatch.contract.layout import rank_file_name
from trainwatch.rank.checkpoint import rng
from trainwatch.rank.memory_snapshots import rank_parts, store
from trainwatch.rank.memory_snapshots.gasp_on_term import GaspOnTerm
from trainwatch.rank.memory_snapshots.rank_parts import RankParts

log = logging.getLogger(__name__)

GASP_DIR = "gasp"
SECONDS = 20.0      # the longest a gasp may hold teardown up (torchrun waits 30 s)


def gasp_folder(root: Path, rank: int) -> Path:
    return root / GASP_DIR / rank_file_name(rank, "")


def _tensors(tree: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _tensors(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _tensors(v, out)
    return out


def _storages(tensors: list[torch.Tensor]) -> list[int]:
    return [t.untyped_storage().data_ptr() for t in tensors]


class DyingGasp:
    """One rank's gasp: ``after_step`` every step, ``gasp`` at teardown, ``close``."""

    def __init__(self, snaps: Any):
        self.snaps = snaps
        self._lock = threading.Lock()
        self._step: int | None = None
        self._state: Callable[[], dict[str, Any]] | None = None
        self._clean = False
        self._tensors: list[torch.Tensor] = []
        self._storages: list[int] = []
        self._versions = 0
        self._hook: Any = None
        self.on_term: GaspOnTerm | None = None   # the gasp at a SIGTERM blocked in C
        self._pinned: int | None = None  # the resumed step: its gasps and parts kept
        self._once = threading.Lock()
        self._gasped: int | None = None  # the step a gasp was started for (one per step)
        self._worker: threading.Thread | None = None  # that gasp's thread
        self.parts: RankParts | None = None
        self._noted: tuple[int, tuple[Any, ...], Any] | None = None  # step, RNGs, position
        self.facts: dict[str, Any] = {"step": None, "written": None, "reason": None,
                                      "why_not": None, "seconds": None}

    @property
    def active(self) -> bool:
        """Snapshots on, the state looked at and not sharded: replicas to stand in."""
        s = self.snaps
        return bool(s.enabled and s.root is not None and s._looked and not s._sharded)

    def after_step(self, step: int, state: Callable[[], dict[str, Any]],
                   data: Callable[[], Any]) -> None:
        """The loop, every step after the snapshotter: step ``step``'s state is complete."""
        if not self.active or self.snaps.every == 1:
            return  # (a snapshot every step: the gasp has nothing to add)
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(self._stepping)
            atexit.register(self.at_exit)
            self.on_term = GaspOnTerm(self.gasp)
            self.on_term.start()
        if self._step is None:
            self._start()
        elif self._pinned is not None and self.snaps._confirmed > self._pinned:
            store.retain(gasp_folder(self.snaps.root, self.snaps.rank), set())
            self._pinned = None  # a newer snapshot every rank has: the resumed step's go
            if self.parts is not None:
                self.parts.pinned = None
        with self._lock:
            if self._step is None or step % 100 == 0:  # what the state holds, now and then
                self._tensors = _tensors(state(), [])
                self._storages = _storages(self._tensors)
            self._versions = sum(t._version for t in self._tensors)
            self._step, self._state, self._clean = step, state, True
        self._noted = (step, rng.capture_raw(), copy.deepcopy(data()))
        if self.snaps.world_size > 1:  # another rank's gasp may stand in for this one's
            if self.parts is None:
                self.parts = RankParts(self.snaps.root, self.snaps.rank, self.snaps.world_size,
                                       self.snaps.config_hash)
                self.parts.pinned = self._pinned
            sealed = self.parts.note(step, *self._noted[1:])
            if sealed is not None:  # to the peer node too: it outlives this node's ranks
                self.snaps.peers.offer_part(sealed, self.snaps.world_size)

    def _start(self) -> None:
        """This process's history starts at the step it resumed from (-1: none): parts and
        gasps of later steps belong to a lost history and go; the resumed step's stay until
        a newer snapshot every rank has is sealed (a second failure may need them)."""
        resumed = self.snaps._sealed
        root, rank = self.snaps.root, self.snaps.rank
        for folder in (gasp_folder(root, rank), rank_parts.parts_folder(root, rank)):
            store.retain(folder, {resumed})
        self._pinned = resumed if resumed >= 0 else None

    def _stepping(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Any optimizer's step is starting: the state stops being step N's."""
        with self._lock:
            self._clean = False

    # ------------------------------------------------------------------ the gasp
    def idle(self) -> str | None:
        """Why this rank has no gasp to write (None: it may have one)."""
        s = self.snaps
        if not s.enabled:
            return str(s.facts.get("off_reason") or "memory snapshots are off")
        if s._sharded:
            return "sharded (DTensor) state: no replica holds this rank's shards"
        if s.every == 1:
            return "a snapshot every step: the gasp has nothing to add"
        if not self.active or self._noted is None:
            return "no step completed yet"
        return None

    def gasp(self, reason: str, timeout: float = SECONDS) -> dict[str, Any]:
        """Write step N's state if it is still that, on a thread joined for at most
        ``timeout`` s; never raises. Once per step: a second caller (the teardown after a
        request, or after the SIGTERM reader's gasp) waits for the first's write, within
        the same bound, so the process does not exit under it. What it did (``facts``)."""
        idle = self.idle()
        if idle is not None:
            return {"step": self._step, "written": False, "why_not": idle}
        with self._once:
            worker = self._worker
            if self._gasped != self._step or worker is None:
                self._gasped = self._step
                worker = self._worker = threading.Thread(
                    target=self._gasp, args=(reason,), daemon=True,
                    name="trainwatch-dying-gasp")
                worker.start()
        worker.join(timeout)
        if worker.is_alive():
            log.warning("trainwatch: dying gasp of step %s not done in %.0f s: left",
                        self._step, timeout)
            return {"step": self._step, "written": False,
                    "why_not": f"not done in {timeout:.0f} s"}
        return {**self.facts, "step": self._step}

    def _gasp(self, reason: str) -> None:
        started = time.perf_counter()
        try:
            written, why = self._write(reason)
        except Exception as exc:  # a gasp that fails costs what it would have saved, no more
            written, why = None, f"{type(exc).__name__}: {exc}"
        seconds = round(time.perf_counter() - started, 3)
        self.facts.update(step=self._step, written=written is not None, reason=reason,
                          why_not=why, seconds=seconds)
        fields: dict[str, Any] = {"step": self._step, "trigger": reason,
                                  "written": written is not None, "seconds": seconds}
        if written is not None:
            fields.update(path=str(written.path), bytes=written.bytes)
        else:
            fields["why_not"] = why
        try:
            self.snaps.journal("memory_snapshot_gasp", **fields)
        except Exception as exc:  # the journal is not worth a traceback at teardown
            log.warning("trainwatch: could not journal the dying gasp: %s", exc)

    def _write(self, reason: str) -> tuple[store.Sealed | None, str | None]:
        s = self.snaps
        with self._lock:  # no optimizer step starts while the state is read
            step, state = self._step, self._state
            assert step is not None and state is not None
            if not self._clean:
                return None, f"an optimizer step began after step {step}"
            if sum(t._version for t in self._tensors) != self._versions:
                return None, f"the state changed in place after step {step}"
            if s._sealed >= step:
                return None, f"step {step}'s snapshot is already sealed"
            trees = state()
            if _storages(_tensors(trees, [])) != self._storages:
                return None, "the state's tensors are not those of step N (replaced)"
            last = self._noted
            if last is None or last[0] != step:
                return None, f"no RNG states and data position noted at step {step}"
            payload = {"step": step, "gasp": reason,
                       "shared": {k: v for k, v in trees.items() if k != "data"},
                       "rank": rank_parts.rank_state(last[1], last[2])}
            folder = store.make_folder(gasp_folder(s.root, s.rank))
            sealed = store.seal(folder, rank=s.rank, step=step, world_size=s.world_size,
                                config_hash=s.config_hash,
                                write=lambda f: torch.save(payload, f),
                                version=store.TORCH_SAVED)
        store.retain(folder, {step})
        return sealed, None

    def at_exit(self) -> None:
        """The interpreter exits and nobody closed the checkpointer (an own loop that
        raised): the gasp, unless the run finished."""
        if not self.snaps._finished:
            self.gasp("the process exited before the run finished")

    # ------------------------------------------------------------------ the end
    def close(self, finished: bool) -> None:
        """Remove the hooks; at the run's end remove this rank's parts
        and gasps, then the folders above them when they are empty (the last rank's)."""
        if self._hook is not None:
            self._hook.remove()
            atexit.unregister(self.at_exit)
            self._hook = None
        if self.on_term is not None:
            self.on_term.close()
            self.on_term = None
        root = self.snaps.root
        if not finished or root is None:
            return
        for folder in (rank_parts.parts_folder(root, self.snaps.rank),
                       gasp_folder(root, self.snaps.rank)):
            shutil.rmtree(folder, ignore_errors=True)
        for folder in (root / rank_parts.PARTS_DIR, root / GASP_DIR, root):
            try:
                folder.rmdir()
            except OSError:
                pass
