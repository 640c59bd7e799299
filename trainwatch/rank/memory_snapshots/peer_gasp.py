"""A job on several nodes resumes from a dying gasp too, before the peer exchange.

On one node, resume.py asks gasp_resume.py for a step newer than every rank's snapshot that
a replica holds whole (its snapshot or its gasp) and every rank holds its own part of. On
several nodes the ranks go through the peer exchange (peer_resume.py), which moves whole
snapshots between nodes and knew no gasps: the survivors' gasps were written and not used.
Data-parallel state is the same on every replica, so a rank needs no other node's gasp: it
reads a replica's on its own node (every rank of a node shares its /dev/shm). The rule is
gasp_resume's with each rank's node (``plan(node_of=...)``): a step counts when every node
holds it whole among its ranks and every rank holds its own part. When no step beats the
snapshots on every node, a node may have had no survivor (all its ranks died at once, or it
was replaced): peer_gasp_fetch.py sends its ranks another node's gasp and the parts their
peer holds. When neither finds a step (another world size, parts not sent in time), the
exchange decides as before.
"""

from __future__ import annotations

from typing import Any, Callable

from trainwatch.rank.checkpoint.resume import Restored
from trainwatch.rank.memory_snapshots import gasp_resume, peer_gasp_fetch
from trainwatch.rank.memory_snapshots import resume as local
from trainwatch.rank.memory_snapshots.agree import Found, newest_common
from trainwatch.rank.memory_snapshots.peer_copies import PeerCopies
from trainwatch.rank.memory_snapshots.snapshotter import MemorySnapshots


def resume(snaps: MemorySnapshots, copies: PeerCopies, facts: dict[str, Any],
           live: Callable[[], Any] | None) -> tuple[Restored | None, str]:
    """Every rank (collective): the gasp step the ranks agreed on, loaded; or None and why
    not (then the exchange decides). A file that does not load drops its step, journaled
    as ``memory_snapshot_rejected``, and the next one is tried."""
    if live is not None or snaps.root is None:
        return None, "sharded state has no replicas"
    mine = local.found_here(snaps)
    gasp_resume.found_parts(mine, snaps.root, snaps.rank, snaps.world_size, snaps.config_hash)
    mine.durable_step, mine.rollback_at = facts["durable"], facts["rollback_at"]
    found: list[Found] = copies.collective.all_gather(mine)
    excluded: set[int] = set()
    while True:
        beat = newest_common(found, frozenset(excluded)).step
        chosen = gasp_resume.plan(found, frozenset(excluded), beat, copies.node_of)
        if chosen is None:  # no node-local step: a node may have had no survivor
            # newer than any snapshot (older ones are the exchange's, with their copies)
            newest = max((s for f in found for s in f.steps), default=-1)
            floor = max(x for x in (beat, facts["durable"], newest) if x is not None)
            restored, why = peer_gasp_fetch.resume(snaps, copies, floor, frozenset(excluded),
                                                   facts["rollback_at"])
            if restored is None:
                return None, f"no gasp step newer than the snapshots every rank has ({why})"
            snaps.resumed(restored.step)
            copies.after_resume(restored.step)
            return restored, why
        restored, problem = gasp_resume.load(snaps.root, snaps.rank, chosen,
                                             snaps.world_size, local.load_file)
        if restored is not None:
            problem = local.check_fit(restored, live)
        problems = copies.collective.all_gather(problem)
        bad = {r: p for r, p in enumerate(problems) if p is not None}
        if not bad:
            assert restored is not None
            restored.manifest.update(transfers=0)
            snaps.resumed(chosen.step)
            copies.after_resume(chosen.step)
            return restored, chosen.reason
        if snaps.rank == 0:
            snaps.journal("memory_snapshot_rejected", step=chosen.step,
                          ranks={str(r): p for r, p in sorted(bad.items())[:8]})
        excluded.add(chosen.step)
