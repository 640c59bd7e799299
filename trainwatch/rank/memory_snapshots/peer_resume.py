"""Resume from memory wherever the state is: the local snapshots, or the peer copies.

A job on one node (and that was on one node) resumes as resume.py does: every rank from
its own snapshot, at the same world size. Where peer copies run (peer_link.py: the job is
on more than one node, or a node holds copies of an earlier, larger world), the ranks go
through the peer exchange instead (peer_fetch.py): every rank lists what its node has (its
share of the node's own snapshots and held copies, each verified), the ranks take the
newest step every rank of the new world has somewhere, and the holders send what a rank
lacks. So a replaced node (an empty /dev/shm) and a smaller world (an elastic job that lost
a node) resume from memory too. Data-parallel state first looks for a dying gasp newer than
the snapshots, each node's ranks reading a replica's on their node (peer_gasp.py). The
local path's rules hold here as well: a snapshot of another config, sealed before the
controller's last rollback, or not newer than the durable checkpoint is never used.

Sharded (DTensor) state is checked against the job's own DTensors as resume.py does
(``check_fit``): at the same world size and mesh a rank's shards come back from wherever
they were held; at another world size they do not fit, and the durable checkpoint (which
DCP reshards) is used. At another world size, data-parallel state: new rank r loads old
rank r's state, a rank beyond the old world old rank 0's; every rank
continues from rank 0's data position and a new rank gets RNGs derived from rank 0's, as a
durable checkpoint at another world size does (docs/checkpoints.md, "Another world size").
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from trainwatch.contract.layout import rank_of_file
from trainwatch.rank.checkpoint.resume import Restored, derived_rng
from trainwatch.rank.memory_snapshots import gasp_resume, peer_gasp
from trainwatch.rank.memory_snapshots import resume as local
from trainwatch.rank.memory_snapshots import store
from trainwatch.rank.memory_snapshots.peer_copies import PeerCopies
from trainwatch.rank.memory_snapshots.peer_fetch import FETCHED, HELD, OWN, fetch_newest_common
from trainwatch.rank.memory_snapshots.peer_store import SnapshotFile
from trainwatch.rank.memory_snapshots.snapshotter import MemorySnapshots
from trainwatch.rundir.run_dir import RunDir

SOURCE_PEER = "peer copy"   # state_from when any rank's state came from a copy
MAX_LISTED = 8              # ranks named in the journal's ``from_peers``
# what checkpoint_resumed adds for a resume through the exchange (``_journal_fields``)
JOURNALED = ("sources", "from_peers", "newest_step", "steps_lost", "transfers", "rejected")


def resume(snaps: MemorySnapshots, run: RunDir, durable_step: int | None,
           live: Callable[[], Any] | None = None) -> tuple[Restored | None, str]:
    """Every rank: the snapshot the ranks agreed on, loaded, or None and why (journaled).
    ``live``: the job's own DTensors, for a sharded snapshot (resume.py)."""
    # what the local resume agrees on rides with prepare's gather (one collective less)
    found = snaps.prepare(carry=lambda: local.found_mine(snaps, run, durable_step, live))
    if not snaps.enabled or not snaps.peers.active:
        return local.resume(snaps, run, durable_step, live, found)
    copies = snaps.peers.copies
    assert copies is not None
    facts = copies.collective.broadcast(
        {"durable": durable_step, "rollback_at": local.rollback_at(run)}
        if copies.rank == 0 else None)
    gasped, why_not = peer_gasp.resume(snaps, copies, facts, live)
    if gasped is not None:  # a survivor's gasp on each node: newer than any snapshot
        return _finish(snaps, copies, gasped, why_not)
    accept = Acceptor(snaps.config_hash, facts["durable"], facts["rollback_at"])
    own = own_snapshots(snaps.root, copies, accept)
    outcome = fetch_newest_common(copies, own, accept=accept)
    if outcome.resume is None:
        return None, accept.explain(outcome.reason)
    mine = outcome.resume
    restored, problem = local.load_file(mine.snapshot.path, mine.step, snaps.world_size)
    if restored is not None:
        problem = local.check_fit(restored, live)
    done = copies.collective.all_gather({
        "problem": problem, "source": mine.source, "state_of": mine.snapshot.rank,
        "from_rank": mine.from_rank, "newest": max((s.step for s in own), default=None)})
    bad = {r: d["problem"] for r, d in enumerate(done) if d["problem"] is not None}
    copies.release_fetched()
    misfit = local.misfit_reason(mine.step, [d["problem"] for d in done])
    if misfit is not None:
        return None, misfit
    if bad or restored is None:
        first = min(bad) if bad else copies.rank
        return None, f"step {mine.step}: rank {first}'s snapshot did not load: {bad.get(first)}"
    if mine.world_size != snaps.world_size:
        _other_world(restored, copies, mine.world_size)
    restored.manifest.update(_journal_fields(done, copies, mine.step, outcome))
    snaps.resumed(mine.step)
    return _finish(snaps, copies, restored, outcome.reason)


def _finish(snaps: MemorySnapshots, copies: PeerCopies, restored: Restored,
            reason: str) -> tuple[Restored, str]:
    _tidy(snaps.root, copies)
    if copies.off_reason:  # a world on one node keeps no copies
        snaps.peers.close()
    return restored, reason


def resumed_fields(restored: Restored, reason: str, durable_step: int | None) -> dict[str, Any]:
    """What ``checkpoint_resumed`` says of a resume from memory, the same for the
    Checkpointer and the framework callbacks: the source, why, the durable step it beat,
    the steps kept and lost (and whose replica a dying gasp's state is)."""
    peer = {k: restored.manifest.get(k) for k in JOURNALED + gasp_resume.JOURNALED}
    return {"step": restored.step, "path": str(restored.path),
            "state_from": restored.manifest["source"], "reason": reason,
            "durable_step": durable_step, "steps_kept": restored.step - (durable_step or 0),
            "load_seconds": restored.manifest["load_seconds"], **peer}


class Acceptor:
    """Which snapshot files the job may resume from: this config, sealed after the last
    rollback, newer than the durable checkpoint. ``__call__(path)``: '' or why not."""

    def __init__(self, config_hash: str | None, durable: int | None, rollback_at: float | None):
        self.config_hash, self.durable, self.rollback_at = config_hash, durable, rollback_at
        self.older: int | None = None   # the newest step left out for the durable checkpoint

    def header(self, s: store.Sealed) -> str:
        if s.world_size is None:
            return "no world size"
        if s.config_hash != self.config_hash:
            return "written by another config"
        if self.rollback_at is not None and (s.sealed_at or 0) < self.rollback_at:
            return "sealed before the last rollback"
        if self.durable is not None and s.step <= self.durable:
            self.older = max(self.older or s.step, s.step)
            return "not newer than the durable checkpoint"
        return ""

    def __call__(self, path: Path) -> str:
        try:
            return self.header(store.sealed_file(path))
        except store.Rejected as exc:
            return str(exc)

    def explain(self, reason: str) -> str:
        if self.older is None:
            return reason
        return (f"snapshot step {self.older} is not newer than the durable checkpoint "
                f"(step {self.durable}); {reason}")


def rank_folders(root: Path) -> list[Path]:
    """The rank folders (``rank-NNNNN``) of a run's snapshot root on this node."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [root / n for n in names if rank_of_file(Path(n)) is not None
            and (root / n).is_dir() and not (root / n).is_symlink()]


def node_ranks(copies: PeerCopies) -> list[int]:
    return [r for r, n in enumerate(copies.node_of) if n == copies.node_of[copies.rank]]


def own_snapshots(root: Path | None, copies: PeerCopies, accept: Acceptor) -> list[SnapshotFile]:
    """This rank's share of the sealed snapshots in its node's rank folders (its own, and
    those of ranks renumbered or gone), each verified whole: the node's ranks split the
    folders, so each file is read once."""
    if root is None:
        return []
    here = node_ranks(copies)
    share = here.index(copies.rank)
    found = []
    for i, folder in enumerate(rank_folders(root)):
        if i % len(here) != share:
            continue
        for s in store.sealed(folder):
            if accept.header(s):
                continue
            try:
                store.verify(s.path)
            except store.Rejected:
                continue
            assert s.world_size is not None
            found.append(SnapshotFile(s.rank, s.step, s.world_size, s.digest, s.path))
    return found


def _other_world(restored: Restored, copies: PeerCopies, written: int) -> None:
    """The durable checkpoint's world-size rules: rank 0's data position on every rank; a
    rank beyond the old world (it loaded old rank 0's state) gets RNGs derived from it."""
    me, world = copies.rank, copies.world_size
    data = copies.collective.broadcast(restored.rank_state.get("data") if me == 0 else None)
    if me >= written:
        restored.rank_state["rng"] = derived_rng(restored.rank_state["rng"], me)
    restored.rank_state["data"] = data
    restored.resharded = {"from_world_size": written, "to_world_size": world,
                          "data": "rank 0's position, on every rank",
                          "rng_reseeded": list(range(written, world)) or None}


def _journal_fields(done: list[dict[str, Any]], copies: PeerCopies, step: int,
                    outcome: Any) -> dict[str, Any]:
    """What ``checkpoint_resumed`` says of a resume through the exchange: where each rank's
    state came from and the steps that were lost."""
    counts = {OWN: 0, HELD: 0, FETCHED: 0}
    listed: list[dict[str, Any]] = []
    for rank, d in enumerate(done):
        counts[d["source"]] = counts.get(d["source"], 0) + 1
        if d["source"] != OWN and len(listed) < MAX_LISTED:
            listed.append({"rank": rank, "state_of": d["state_of"],
                           "copy": "held on its node" if d["source"] == HELD else "sent",
                           "from_rank": d["from_rank"],
                           "from_node": copies.node_names[d["from_rank"]]})
    newest = max((d["newest"] for d in done if d["newest"] is not None), default=step)
    fields: dict[str, Any] = {
        "source": SOURCE_PEER if counts[HELD] or counts[FETCHED] else local.SOURCE,
        "sources": counts, "from_peers": listed or None, "newest_step": max(newest, step),
        "steps_lost": max(newest, step) - step, "transfers": outcome.transfers}
    if outcome.rejected:
        fields["rejected"] = outcome.rejected[:4]
    return fields


def _tidy(root: Path | None, copies: PeerCopies) -> None:
    """The node's folders of ranks beyond the new world (a smaller world's, or renumbered
    ones) hold only the old history now: one rank per node removes them."""
    if root is None or node_ranks(copies)[0] != copies.rank:
        return
    for folder in rank_folders(root):
        rank = rank_of_file(folder)
        if rank is not None and rank >= copies.world_size:
            shutil.rmtree(folder, ignore_errors=True)
