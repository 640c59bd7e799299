"""A job on several nodes resumes from a dying gasp too, before the peer exchange.

On one node, resume.py asks gasp_resume.py for a step newer than every rank's snapshot that
a replica holds whole (its snapshot or its gasp) and every rank holds its own part of. On
several nodes the ranks go through the peer exchange (peer_resume.py), which moves whole
snapshots between nodes and knew no gasps: the survivors' gasps were written and not used.
Data-parallel state is the same on every replica, so a rank needs no other node's gasp: it
reads a replica's on its own node (every rank of a node shares its /dev/shm). The rule is
gasp_resume's with each rank's node (``plan(node_of=...)``): a step counts when every node
holds it whole among its ranks and every rank holds its own part. When no step beats the
snapshots (a replaced node: its ranks' parts went with it; another world size; a node whose
every rank died), the exchange decides as before.
"""

from __future__ import annotations

from typing import Any, Callable

from trainwatch.rank.checkpoint.resume import Restored
from trainwatch.rank.memory_snapshots import gasp_resume
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
        if chosen is None:
            return None, "no gasp step newer than the snapshots every rank has"
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
