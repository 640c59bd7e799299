"""At resume: find the newest step every rank of the new world can have, and fetch the
snapshots a rank lacks from the ranks that hold them.

Interface:

    outcome = fetch_newest_common(copies, own, replicated=True)   # collective
    outcome.resume   # PeerResume(step, world_size, snapshot to load, source, from_rank) or None
    outcome.reason   # why none (then resume from the durable checkpoint), or what was done

``own``: this rank's sealed, verified snapshots (the snapshotter's store lists them; any
rank's, on a node where ranks were renumbered). Every rank reports them and its share of
its node's held copies, each verified here (``Entry``), all ranks gather the inventory, and
the pure ``choose_step`` picks the newest step for which every rank of the new world has a
verified copy somewhere; ``plan`` says who reads a copy on its own node and who is sent one
(``Transfer``). A rank whose node was replaced (an empty /dev/shm) gets its snapshot from
the rank that held its copy. When any transfer fails, no rank resumes from memory.

Another world size (docs/memory-snapshots.md, "Peer copies"): with ``replicated`` state
(data parallel: every rank's snapshot has the whole model and optimizer) new rank ``r``
loads old rank ``r``'s snapshot, and a rank beyond the old world old rank 0's; the old
world's ranks beyond the new one are not needed. Their RNGs and data positions follow the
durable checkpoint's world-size rules (docs/checkpoints.md, "Another world size"). Sharded
state is resumed from memory only at the world size that wrote it (the durable checkpoint
reshards).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainwatch.rank.memory_snapshots import peer_wire as wire
from trainwatch.rank.memory_snapshots.peer_copies import PeerCopies
from trainwatch.rank.memory_snapshots.peer_store import SnapshotFile

OWN, HELD, FETCHED = "own", "held", "fetched"


@dataclass(frozen=True)
class Entry:
    """A verified snapshot rank ``holder`` (of the new world) can read: ``rank``'s state
    (a rank of the world that wrote it) at ``step``."""

    holder: int
    rank: int
    step: int
    world_size: int
    digest: str
    path: str
    own: bool


@dataclass(frozen=True)
class Choice:
    step: int
    world_size: int                       # of the world that wrote the snapshots
    digests: dict[int, str]               # state rank -> the digest chosen


@dataclass(frozen=True)
class Transfer:
    source: int      # the rank that sends
    to_rank: int     # the rank that needs it
    entry: Entry


@dataclass(frozen=True)
class PeerResume:
    step: int
    world_size: int
    snapshot: SnapshotFile                # the file this rank loads
    source: str                           # own, held (a copy on its node) or fetched
    from_rank: int                        # the rank it was read or sent from


@dataclass
class ExchangeOutcome:
    resume: PeerResume | None
    reason: str
    rejected: list[str] = field(default_factory=list)   # copies that did not verify, job-wide
    transfers: int = 0


def wanted_rank(new_rank: int, world_size: int) -> int:
    """Whose snapshot new rank ``new_rank`` loads when ``world_size`` ranks wrote them."""
    return new_rank if new_rank < world_size else 0


def _pick_digest(entries: list[Entry]) -> str:
    """One state's digest when copies differ: its owner's, else the most held one."""
    owners = sorted(e.digest for e in entries if e.own)
    if owners:
        return owners[0]
    counts = Counter(e.digest for e in entries)
    return min(counts, key=lambda d: (-counts[d], d))


def choose_step(entries: list[Entry], new_world: int, replicated: bool = True
                ) -> tuple[Choice | None, str]:
    """The newest step (and the world that wrote it) for which every rank of a
    ``new_world``-rank job has a verified snapshot; else None and why not."""
    groups: dict[tuple[int, int], list[Entry]] = {}
    for e in entries:
        groups.setdefault((e.step, e.world_size), []).append(e)
    why = "no verified snapshot on any rank"
    for step, world in sorted(groups, key=lambda k: (k[0], len(groups[k])), reverse=True):
        if not replicated and world != new_world:
            why = (f"step {step}: sharded state of {world} ranks cannot resume on {new_world} "
                   "from memory (the durable checkpoint reshards)")
            continue
        by_rank: dict[int, list[Entry]] = {}
        for e in groups[(step, world)]:
            by_rank.setdefault(e.rank, []).append(e)
        needed = range(min(new_world, world)) if replicated else range(world)
        missing = [r for r in needed if r not in by_rank]
        if missing:
            if why.startswith("no verified"):
                why = f"step {step} (the newest) has no verified copy of rank(s) " + \
                      ", ".join(map(str, missing))
            continue
        return Choice(step, world, {r: _pick_digest(by_rank[r]) for r in needed}), ""
    return None, why


def plan(choice: Choice, entries: list[Entry], new_world: int, node_of: list[int]
         ) -> tuple[dict[int, Entry], list[Transfer]]:
    """Each new rank's snapshot: read where it is on its own node (``local``), or sent
    by a rank that holds it (``transfers``, spread over the holders)."""
    usable: dict[int, list[Entry]] = {}
    for e in entries:
        if e.step == choice.step and e.world_size == choice.world_size and \
                choice.digests.get(e.rank) == e.digest:
            usable.setdefault(e.rank, []).append(e)
    local: dict[int, Entry] = {}
    transfers: list[Transfer] = []
    load: Counter[int] = Counter()
    for new_rank in range(new_world):
        candidates = usable[wanted_rank(new_rank, choice.world_size)]
        here = [e for e in candidates if node_of[e.holder] == node_of[new_rank]]
        if here:
            local[new_rank] = min(here, key=lambda e: (e.holder != new_rank, not e.own, e.holder))
            continue
        source = min(candidates, key=lambda e: (load[e.holder], not e.own, e.holder))
        load[source.holder] += 1
        transfers.append(Transfer(source.holder, new_rank, source))
    return local, transfers


def inventory(copies: PeerCopies, own: list[SnapshotFile],
              accept: Callable[[Path], str] | None = None) -> tuple[list[Entry], list[str]]:
    """This rank's verified snapshots: its ``own`` and its share of its node's held copies
    (the node's ranks split the held folders, so each is verified once). ``accept(path)``:
    '' for a held copy the job may resume from, else why not (another config, before a
    rollback, not newer than the durable checkpoint): left out, not counted as rejected."""
    entries = [Entry(copies.rank, s.rank, s.step, s.world_size, s.digest, str(s.path), True)
               for s in own]
    node_ranks = [r for r, n in enumerate(copies.node_of) if n == copies.node_of[copies.rank]]
    share = node_ranks.index(copies.rank)
    rejected = []
    for i, held_rank in enumerate(copies.held.held_ranks()):
        if i % len(node_ranks) != share:
            continue
        for copy in copies.held.copies(held_rank):
            if accept is not None and accept(copy.snapshot.path):
                continue
            problem = copies.held.verify(copy)
            s = copy.snapshot
            if problem:
                rejected.append(f"rank {copies.rank}: copy of rank {s.rank} step {s.step}: {problem}")
                continue
            entries.append(Entry(copies.rank, s.rank, s.step, s.world_size, s.digest,
                                 str(s.path), False))
    return entries, rejected


def _send(copies: PeerCopies, mine: list[Transfer], failures: list[str]) -> None:
    for t in mine:
        e = t.entry
        try:
            answer = copies.push(t.to_rank, SnapshotFile(e.rank, e.step, e.world_size,
                                                         e.digest, Path(e.path)))
        except (wire.WireError, OSError) as exc:
            answer = str(exc)
        if answer != "stored":
            failures.append(f"rank {copies.rank} -> rank {t.to_rank} (rank {e.rank}'s "
                            f"step {e.step}): {answer}")


def fetch_newest_common(copies: PeerCopies, own: list[SnapshotFile], replicated: bool = True,
                        accept: Callable[[Path], str] | None = None) -> ExchangeOutcome:
    """Collective: the snapshot this rank resumes from, fetched if it is elsewhere, or why
    the job resumes from its durable checkpoint instead (the same answer on every rank).
    ``accept``: which held copies may be used (``inventory``)."""
    coll, me = copies.collective, copies.rank
    entries, rejected = inventory(copies, own, accept)
    gathered = coll.all_gather({"entries": [asdict(e) for e in entries], "rejected": rejected})
    everything = [Entry(**e) for g in gathered for e in g["entries"]]
    rejected = [r for g in gathered for r in g["rejected"]]
    choice, why = choose_step(everything, copies.world_size, replicated)
    if choice is None:
        return ExchangeOutcome(None, why, rejected)
    local, transfers = plan(choice, everything, copies.world_size, copies.node_of)
    for t in transfers:
        if t.to_rank == me:
            copies.receiver.expect(t.entry.rank, t.entry.step, t.entry.digest)
    coll.all_gather(None)  # every receiver expects its snapshot before any is sent
    failures: list[str] = []
    sender = threading.Thread(target=_send, args=(copies, [t for t in transfers if t.source == me],
                                                  failures), daemon=True)
    sender.start()
    arrived = copies.receiver.wait_fetched(copies.settings.fetch_timeout_s) \
        if any(t.to_rank == me for t in transfers) else {}
    sender.join(copies.settings.fetch_timeout_s)
    want = wanted_rank(me, choice.world_size)
    resume: PeerResume | None = None
    try:
        resume = _mine(copies, choice, local, transfers, arrived)
    except (LookupError, OSError) as exc:
        failures.append(f"rank {me}: rank {want}'s step {choice.step}: {exc}")
    failures = [f for g in coll.all_gather(failures) for f in g]
    if failures or resume is None:
        return ExchangeOutcome(None, "fetching the snapshots failed: " + "; ".join(failures[:4]),
                               rejected, len(transfers))
    copies.after_resume(choice.step)   # safe: every rank's snapshot is its own or linked
    return ExchangeOutcome(resume, f"step {choice.step}: {len(transfers)} snapshot(s) fetched",
                           rejected, len(transfers))


def _mine(copies: PeerCopies, choice: Choice, local: dict[int, Entry],
          transfers: list[Transfer], arrived: dict[int, Any]) -> PeerResume:
    """This rank's snapshot; a copy held on its node is linked into its ``fetched`` folder
    first, so tidying the node's held folder cannot take it away before it is loaded."""
    me = copies.rank
    if me in local:
        e = local[me]
        snapshot = SnapshotFile(e.rank, e.step, e.world_size, e.digest, Path(e.path))
        if not e.own:
            snapshot = copies.fetched.adopt(snapshot)
        return PeerResume(choice.step, choice.world_size, snapshot, OWN if e.own else HELD,
                          e.holder)
    copy = arrived.get(wanted_rank(me, choice.world_size))
    if copy is None:
        raise LookupError(f"did not arrive within {copies.settings.fetch_timeout_s:g} s")
    sender_rank = next(t.source for t in transfers if t.to_rank == me)
    return PeerResume(choice.step, choice.world_size, copy.snapshot, FETCHED, sender_rank)
