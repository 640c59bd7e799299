"""Take a rank's snapshot at a step boundary and write it off the loop's thread.

At a snapshot step the loop (1) waits for the previous write, if it is still running,
(2) joins one all_reduce with the other ranks (the newest step every rank has sealed, which
each rank keeps while it writes the next, and the largest K any rank proposes: every rank
snapshots the same steps), (3) copies its state to host buffers (capture.py, reused) and
moves on; a writer thread writes the copy into the tmpfs and seals it (payload.py's raw
tensors, store.py's header and digest: calls that release the GIL, so the loop runs on). The
loop never waits for a write it did not need to; a tmpfs without room or a failed write
skips that snapshot, counts it and journals the first of its kind: never the job's failure.

Sharded (FSDP2, DTensor) state: each rank snapshots its own shards, the DTensors' local
tensors, with a record of their mesh, placements and shapes (shards.py); nothing is
gathered, and the writer thread never joins a collective.

Host memory per rank: the host copy (the state's size, kept between snapshots) and at most
two snapshot files in the tmpfs (each the state's size): three times the rank's state
(sharded: the rank's shards).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainwatch.rank.checkpoint import rng, whole_state
from trainwatch.rank.object_gather import gather_objects
from trainwatch.rank.memory_snapshots import payload as payload_format
from trainwatch.rank.memory_snapshots import peer_link, shards, store
from trainwatch.rank.memory_snapshots.cadence import WINDOW, Cadence
from trainwatch.rank.memory_snapshots.capture import HostCopy
from trainwatch.rank.memory_snapshots.live import Live, LiveTrees
from trainwatch.rank.memory_snapshots.overlap import Overlap, Pairs
from trainwatch.rank.memory_snapshots.peer_copies import PeerSettings
from trainwatch.rank.memory_snapshots.rng_watch import RngWatch
from trainwatch.rank.memory_snapshots.writer import Writer

log = logging.getLogger(__name__)

MODES = ("auto", "every_step", "off")
RESERVE_BYTES = 64 << 20   # left free in the tmpfs: NCCL and data loaders share it
CADENCE_EVENTS = 10        # memory_snapshots_cadence events at most (K moves with the load)
DESCRIBE_EVERY = 16        # the status's cadence text refreshed every this many snapshots


class MemorySnapshots:
    """One rank's snapshots: ``prepare`` (every rank, once), ``after_step``, ``close``."""

    def __init__(self, mode: str, root: Path | None, *, rank: int, world_size: int,
                 group: Any, config_hash: str | None, journal: Callable[..., None],
                 why_off: str | None = None, run_dir: Path = Path("."),
                 peers: PeerSettings | None = None, every: int = 0,
                 is_sharded: Callable[[dict[str, Any]], bool] = whole_state.check_trees,
                 durable_every_steps: int = 0):
        self.mode = mode
        self.root = root
        self.rank, self.world_size, self.group = rank, world_size, group
        self.config_hash = config_hash
        self.run_dir = run_dir
        self.journal = journal
        self.is_sharded = is_sharded  # the Checkpointer's one look at the state, shared
        self.folder = store.rank_folder(root, rank) if root is not None else None
        self.cadence = Cadence(mode, durable_every=durable_every_steps)
        self.pinned_every = every  # memory_snapshots_every: K pinned (0: the mode's)
        self._writer_gil = 0.0            # the last write's CPU holding the GIL (payload.py)
        self._verdict: str | None = None  # the cadence last journaled
        self._cadence_events = 0
        self._measured = 0                # snapshots measured (_measure)
        self._described: tuple[int, str] | None = None  # (K, verdict) of the status text
        self._why = ""
        self.every = 1
        self._next: int | None = None
        self._sealed: int = -1            # the newest step this rank sealed
        self._confirmed: int = -1         # the newest step every rank had sealed
        self._host = HostCopy()
        self._live = LiveTrees()  # the live tensors once the layout is known (live.py)
        self._unlearnable: Any = None  # the layout live.py found no plan for
        self._strikes = 0              # plans that failed the snapshot after they were learned
        self._rng = RngWatch()  # numpy's state read again only when it moved
        self._overlap = Overlap()  # a large state's copy beside the next step (overlap.py)
        self._writer = Writer("trainwatch-memory-snapshot")
        self._last_end: tuple[int, float] | None = None
        self._journaled: set[str] = set()
        self._prepared = False
        self._looked = False  # the state was looked at once: sharded (DTensor) or not
        self._sharded = False
        self._finished = False
        # copies on another node's rank (peer_link.py): started by ``prepare``
        self.peers = peer_link.SnapshotPeers(None, peers, peer_link.OFF if peers is None
                                             else "memory snapshots are off", 0)
        self.facts: dict[str, Any] = {
            "enabled": mode != "off" and why_off is None, "mode": mode,
            "root": str(root) if root is not None else None,
            "off_reason": "memory_snapshots: off" if mode == "off" else why_off,
            "every_steps": 1, "cadence": None, "step": None, "bytes": None,
            "blocking_seconds": None, "writer_gil_seconds": None, "taken_total": 0, "skipped_full_total": 0,
            "failed_total": 0, "changed_total": 0, "durable_skipped_total": 0,
            "memory_bound_bytes": None, "peer_copies": self.peers.facts}

    @property
    def enabled(self) -> bool:
        return bool(self.facts["enabled"])

    # ------------------------------------------------------------------ start
    def prepare(self, carry: Callable[[], Any] | None = None) -> list[Any] | None:
        """Every rank, once, at the same point: on only where every rank can keep snapshots
        (else the ranks' collectives would not match), the reasons journaled by rank 0.
        ``carry``: what this rank also tells the others in the same gather (once its
        folder is known to be its own); every rank's answer, or None (on every rank) when
        it was prepared before or any rank had none to give."""
        if self._prepared:
            return None
        self._prepared = True
        mine = self.facts["off_reason"] if not self.enabled else None
        sweep = False
        if mine is None and self.folder is not None and self.root is not None:
            sweep = True
            try:
                store.make_folder(self.folder)
                store.claim(self.root, self.run_dir)
            except OSError as exc:
                mine = f"cannot use {self.folder}: {exc.strerror or exc}"
        info = peer_link.node_facts(self.root) if self.peers.settings is not None else None
        carried = None
        if carry is not None and mine is None:
            try:
                carried = carry()
            except Exception:  # every rank then finds out on its own, as without carry
                carried = None
        # one message a rank (object_gather.py): this is on every resume's path
        gathered: list[Any] = gather_objects((mine, info, carried), self.group)
        if sweep and self.root is not None:
            # runs whose directory is gone, on a thread that nothing waits for: started
            # after the gather, its reading does not hold up this rank's part of it
            with contextlib.suppress(OSError, RuntimeError):  # no thread: no sweep
                store.sweep_aside(self.root.parent)
        reasons = [why for why, _, _ in gathered]
        off = {r: why for r, why in enumerate(reasons) if why is not None}
        self._start(off, gathered)
        told = [c for _, _, c in gathered]
        return None if None in told else told

    def _start(self, off: dict[int, str], gathered: list[Any]) -> None:
        """Start snapshots (and peer copies) when no rank is ``off``; else journal why not."""
        if not off:
            self.peers = peer_link.SnapshotPeers.start(self.peers.settings, self.root,
                                                       self.group, [i for _, i, _ in gathered])
            self.facts["peer_copies"] = self.peers.facts
            if self.rank == 0:
                self.journal("memory_snapshots_started", root=str(self.root), mode=self.mode,
                              ranks=self.world_size, peer_copies=self.peers.describe(),
                              every_steps=1 if self.mode == "every_step" else None,
                              cadence=self._planned(),
                              durable_every_steps=self.cadence.durable_every)
            return
        first = min(off)
        why = off[first] if first == self.rank or self.rank not in off else off[self.rank]
        if self.rank not in off:
            why = f"rank {first}: {off[first]}"
        self.facts.update(enabled=False, off_reason=why)
        if self.rank == 0 and self.mode != "off":
            self.journal("memory_snapshots_off", reason=why,
                          ranks={str(r): w for r, w in sorted(off.items())[:8]})

    def _planned(self) -> str:
        if self.mode == "every_step":
            return "every step (memory_snapshots: every_step), whatever it costs"
        return ("auto: every step while measured; then every step where a snapshot's cost "
                "to the loop (its wait and the writer's GIL time) is within 1 % of step "
                "time, else the smallest K that keeps it there (memory_snapshots_cadence "
                "says which)")

    def resumed(self, step: int) -> None:
        """The job resumed from this snapshot step: every rank has it sealed, so it is kept
        until a newer one is."""
        self._sealed = step

    # ------------------------------------------------------------------ in the loop
    def after_step(self, step: int, state: Callable[[], dict[str, Any]], *,
                   final: bool = False, durable: bool = False,
                   live: Live | None = None) -> None:
        """Snapshot ``step`` (the steps completed) if due; every rank, the same steps.
        ``durable``: this step is saved durably (every rank agreed): no snapshot of it, the
        save's own copy serves, and the next is due K steps on. ``live``: the objects
        ``state()`` reads, for live.py's way without ``state_dict()`` (not sharded state)."""
        if final:
            self._finished = True
        if not self.enabled or final:
            return
        self.prepare()
        if not self.enabled:
            return
        if self._next is None:
            self._next = step
        if step < self._next:
            return
        if durable:
            self._next = step + self.every
            self.facts["durable_skipped_total"] += 1
            return
        started = time.perf_counter()
        self.wait()
        fast = None
        if live is not None and self._looked and not self._sharded:
            fast = self._live.take(live, self._host)
        trees = None
        if fast is None:
            trees = state()
            if not self._looked:
                self._looked = True
                self._sharded = self.is_sharded(trees)  # the same answer on every rank
        proposed = self.pinned_every or self.cadence.every()
        if self.group is not None:
            agreed = torch.tensor([-float(self._sealed), float(proposed)])
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
            sealed, proposed = agreed.tolist()
            self._confirmed, self.every = int(-sealed), max(1, int(proposed))
        else:  # one rank: its own (no tensor to build and read back)
            self._confirmed, self.every = self._sealed, max(1, proposed)
        self._next = step + self.every
        try:
            payload, later = self._capture(step, trees, state, fast, live)
        except Exception as exc:  # e.g. no host memory for the copy: skipped, never the job
            self._overlap.abandon()
            self._count("failed_total", "failed", step, f"{type(exc).__name__}: {exc}")
            return
        self.peers.refresh()
        self.facts["peer_copies"] = self.peers.facts
        try:  # the writer thread, started once (writer.py), copies what is left and writes
            self._writer.submit(lambda: self._write(step, payload, self._confirmed, later))
        except RuntimeError as exc:  # no thread to be had: this snapshot is skipped
            self._overlap.abandon()
            self._count("failed_total", "failed", step, f"no writer thread: {exc}")
        self._measure(step, started, time.perf_counter() - started)

    def _capture(self, step: int, trees: dict[str, Any] | None,
                 state: Callable[[], dict[str, Any]], fast: Any,
                 live: Live | None) -> tuple[dict[str, Any], Pairs]:
        """The payload, its arena filled but for the pairs returned: the writer thread
        copies those (a large state, overlap.py). ``fast``: live.py's (tree, sources, data),
        used when its tensors fit the arena; else ``trees`` (``state()`` if not read yet)."""
        host = self._host
        if fast is not None and host.reuse(fast[0], fast[1]):
            out, sources, data = fast
            if self._overlap.whole(host.layout):  # the common case: one copy, no pairs
                host.copy_all(sources)
                later: Pairs = []
            else:  # pinned to this step's storages: a ``p.data = ...`` before the deferred
                # copy must not be read through the same Parameter (no version moves)
                pinned = [s.detach() for s in sources]
                now, later = self._overlap.split(list(zip(host.layout, pinned)), host.layout)
                host.copy(now)
            self._strikes = 0
            return {"step": step, "shared": out,
                    "rank": {"rng": self._rng.capture_raw(),  # the writer converts it
                             "data": copy.deepcopy(data)}}, later
        if trees is None:
            trees = state()
        shared = {k: v for k, v in trees.items() if k != "data"}
        record = None
        if self._sharded:  # this rank's own shards, and where each sits (no collective)
            shared, record = shards.split(shared)
        out, pairs = host.take(shared)
        if live is not None and record is None:
            self._learn(live, trees, pairs, tried=fast is not None)
        now, later = self._overlap.split(pairs, host.layout)
        host.copy(now)
        payload = {"step": step, "shared": out,
                   "rank": {"rng": self._rng.capture_raw(),  # the writer converts it
                            "data": copy.deepcopy(trees.get("data"))}}
        if record is not None:
            payload["sharded"] = record
        return payload, later

    def _learn(self, live: Live, trees: dict[str, Any], pairs: Pairs, tried: bool) -> None:
        """After a slow take: (re)learn live.py's plan, unless this layout has none, or its
        plans keep failing the snapshot after they are learned (something the checks see
        moves every step: then the slow way, ~0.1 ms less than learning each time)."""
        layout = self._host.layout
        if layout is self._unlearnable:
            return
        if tried:  # a plan of this layout failed its checks: something moved
            self._strikes += 1
            if self._strikes >= 3:
                self._live.forget()
                self._unlearnable = layout
                return
        self._live.learn(live, self._host, trees, [s for _, s in pairs])
        if not self._live.planned:
            self._unlearnable = layout

    def _measure(self, step: int, started: float, blocking: float) -> None:
        measured = self._last_end is not None
        if self._last_end is not None:  # the previous snapshot's writer ran in between
            prev_step, prev_end = self._last_end
            self.cadence.note(blocking, step - prev_step, started - prev_end,
                              self._writer_gil)
        self._last_end = (step, time.perf_counter())
        self._measured += 1
        self.facts.update(every_steps=self.every, blocking_seconds=round(blocking, 6),
                          writer_gil_seconds=round(self._writer_gil, 6))
        verdict = self.cadence.verdict(self.every)
        # the status's text (~30 µs of the loop's: medians, formatting) when K or the
        # verdict moves, over the first measurements, then every DESCRIBE_EVERY snapshots
        if ((self.every, verdict) != self._described or self._measured <= WINDOW
                or self._measured % DESCRIBE_EVERY == 0):
            self._described = (self.every, verdict)
            self._why = self.cadence.why(self.every)
            self.facts["cadence"] = self._why if not self.pinned_every else (
                f"every {self.every} steps (memory_snapshots_every: {self.pinned_every})")
        why = self._why
        if (measured and self.rank == 0 and self.mode != "every_step" and not self.pinned_every
                and verdict != self._verdict and self._cadence_events < CADENCE_EVENTS):
            self._cadence_events += 1
            self.journal("memory_snapshots_cadence", step=step, mode=self.mode,
                          every_steps=self.every, verdict=verdict, why=why,
                          durable_every_steps=self.cadence.durable_every)
            self._verdict = verdict

    def _write(self, step: int, payload: dict[str, Any], confirmed: int,
               later: Pairs) -> None:
        """The writer thread: the copy deferred beside the next step (overlap.py), then
        drop the snapshot no longer needed (its unlink frees the tmpfs pages: kernel time,
        kept off the loop), write, and seal once the copy is known whole; never raises."""
        assert self.folder is not None
        self._overlap.copy(later)
        store.retain(self.folder, {confirmed})
        need = int(self.facts["bytes"] or 0)

        def write(f: Any) -> None:
            cpu = time.thread_time()
            if isinstance(payload["rank"]["rng"], tuple):  # rng.capture's form, here
                payload["rank"]["rng"] = rng.from_raw(payload["rank"]["rng"])
            converted = time.thread_time() - cpu
            self._writer_gil = converted + payload_format.write(f, payload, self._host)
            if not self._overlap.sealable():  # removed unsealed: never a mix of two steps
                raise _Changed(self._overlap.last_changed)

        try:
            sealed = store.seal(self.folder, rank=self.rank, step=step,
                                world_size=self.world_size, config_hash=self.config_hash,
                                write=write, need=need, reserve=RESERVE_BYTES)
        except store.Full as exc:
            self._count("skipped_full_total", "full", step, f"the tmpfs is full: {exc}")
            return
        except _Changed as exc:
            self._count("changed_total", "changed", step, str(exc))
            return
        except Exception as exc:  # a failed snapshot must never fail the job
            self._count("failed_total", "failed", step, f"{type(exc).__name__}: {exc}")
            return
        self._sealed = step
        self.peers.offer(sealed, self.world_size)  # returns at once: the peer's thread sends
        self.facts["taken_total"] += 1
        self.facts.update(step=step, bytes=sealed.bytes,
                          memory_bound_bytes=3 * (sealed.bytes + store.HEADER_BYTES))

    def _count(self, key: str, kind: str, step: int, why: str) -> None:
        self.facts[key] += 1
        if kind not in self._journaled:  # the first of each kind; the status counts them all
            self._journaled.add(kind)
            self.journal("memory_snapshot_skipped", step=step, reason=why,
                          kind=kind, counted_as=key)
        log.warning("trainwatch memory snapshot of step %s skipped: %s", step, why)

    def run_finished(self) -> None:
        """The loop ran its last step: ``close`` removes the snapshots."""
        self._finished = True

    def wait(self) -> None:
        """Until the snapshot in flight is sealed or dropped (its deferred copy checked
        first: the caller is the loop, outside any change of the state)."""
        self._overlap.settle()
        self._writer.wait()

    def close(self) -> None:
        """Wait for the write in flight; after the last step (the run finished), remove this
        rank's snapshots and, the last to go, the run's folder: nothing is left to resume."""
        self._overlap.close()
        self._writer.close()
        self.peers.close(finished=self._finished)
        self.facts["peer_copies"] = self.peers.facts
        if not self._finished or self.folder is None or self.root is None:
            return
        store.retain(self.folder, set())
        (self.root / store.OWNER_FILE).unlink(missing_ok=True)
        for folder in (self.folder, self.root):
            try:
                folder.rmdir()
            except OSError:
                pass


class _Changed(Exception):
    """A deferred copy's tensors changed before the loop checked them: not sealed."""

    def __init__(self, changed: list[int]):
        super().__init__(f"{len(changed)} tensor(s) of the state changed in place while the "
                         "copy beside the next step read them (first: #"
                         f"{changed[0] if changed else '?'}); not sealed, and those are "
                         "copied at the step boundary from now on")


def root_of(folder: str | None, run_dir: Path) -> tuple[Path | None, str | None]:
    """Where the run in ``run_dir`` keeps its snapshots: its own subfolder of ``folder`` or
    of /dev/shm; or (None, why not)."""
    if folder is None:
        return store.default_root(run_dir)
    root, why = store.default_root(run_dir, shm=Path(folder))
    return (Path(folder) / root.name if root is not None else None), why


def for_run(mode: str, folder: str | None, run_dir: Path, **rank: Any) -> MemorySnapshots:
    """The snapshots of a rank of the run in ``run_dir`` (``root_of``), off with the reason
    where there is no folder for them."""
    root, why = root_of(folder, run_dir)
    return MemorySnapshots(mode, root, why_off=why, run_dir=run_dir, **rank)
