"""A rank's snapshots linked to peer copies: started with them, fed each sealed one, reported.

``MemorySnapshots.prepare`` gathers every rank's ``node_facts`` in the collective it already
makes; ``SnapshotPeers.start`` then decides, the same on every rank: peer copies run when
the job's ranks are on more than one node, or when a node holds copies of an earlier world
(an elastic job that lost a node: those copies are what it resumes from). A job that is
and was on one node keeps the local snapshots alone, with the reason in the status. A rank
that cannot start its receiver turns peer copies off on every rank, never the job.

The sender is the peer's own thread with socket timeouts (peer_sender.py): ``offer`` only
puts the snapshot in a slot, so a holder that is gone never slows or hangs a step.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from trainwatch.node import node_name
from trainwatch.rank.memory_snapshots import peer_ring as ring
from trainwatch.rank.memory_snapshots import store
from trainwatch.rank.memory_snapshots.peer_copies import (FETCHED_DIR, HELD_DIR,
                                                         HELD_PARTS_DIR, Collective,
                                                         PeerCopies, PeerSettings,
                                                         PeerStartError, SoloCollective,
                                                         TorchCollective)
from trainwatch.rank.memory_snapshots.peer_store import PeerStore, SnapshotFile

log = logging.getLogger(__name__)

OFF = "peer_copies: off"
SKIPPED = ("full", "busy", "backing_off", "changed", "refused")  # sender counts not stored
REFUSED = ("unauthenticated", "bad", "incomplete", "skipped_full", "over_capacity")
CLOSE_WAIT_S = 1.0   # at the end, a push under way is not waited for longer than this


def settings_from(mode: str, offset: int, clique_size: int, nodes: str) -> PeerSettings | None:
    """The checkpoint section's ``peer_copies*`` keys as settings; None when off."""
    if mode == "off":
        return None
    return PeerSettings(layout=ring.PeerLayout(mode=mode, offset=offset,
                                               clique_size=clique_size, nodes=nodes))


def node_facts(root: Path | None) -> dict[str, Any]:
    """What a rank tells the others at prepare: its node and whether that node holds copies
    (the run spanned nodes before)."""
    held = PeerStore(root / HELD_DIR) if root is not None else None
    return {"node": node_name(),
            "held": bool(held and any(held.copies(r) for r in held.held_ranks())),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)}


def node_of(layout: ring.PeerLayout, infos: list[dict[str, Any]]) -> list[int]:
    if layout.nodes == ring.BY_NAMES:
        return ring.nodes_from_names([str(i["node"]) for i in infos])
    return ring.nodes_from_blocks(len(infos), int(infos[0]["local_world_size"]))


class SnapshotPeers:
    """One rank's peer copies (``copies``; None where off) and their facts for the status."""

    def __init__(self, copies: PeerCopies | None, settings: PeerSettings | None,
                 off_reason: str | None, nodes: int):
        self.copies, self.settings = copies, settings
        self.nodes = nodes
        self.facts: dict[str, Any] = {"enabled": False, "off_reason": off_reason}
        self.refresh()

    @classmethod
    def start(cls, settings: PeerSettings | None, root: Path | None, group: Any,
              infos: list[dict[str, Any]]) -> "SnapshotPeers":
        """Every rank, with every rank's ``node_facts``: collective only where it starts."""
        if settings is None or root is None or not infos or None in infos:
            return cls(None, settings, OFF, 0)
        nodes_of = node_of(settings.layout, infos)
        nodes = len(set(nodes_of))
        try:
            ring.holders(settings.layout, nodes_of)
            why_not = ""
        except ring.NoPeerCopies as exc:
            why_not = str(exc)
        if nodes < 2 and not any(i["held"] for i in infos):
            return cls(None, settings, why_not, nodes)
        collective: Collective = SoloCollective() if group is None else TorchCollective(group)
        try:
            copies = PeerCopies.start(root, settings, collective)
        except PeerStartError as exc:
            log.warning("trainwatch peer copies off: %s", exc)
            return cls(None, settings, f"could not start: {exc}", nodes)
        return cls(copies, settings, copies.off_reason or None, nodes)

    @property
    def active(self) -> bool:
        """The resume goes through the peer exchange (peer_resume.py)."""
        return self.copies is not None

    def describe(self) -> str:
        """For ``memory_snapshots_started``: how copies are kept, or why not."""
        if self.copies is None or self.copies.off_reason:
            return f"off: {self.facts['off_reason']}"
        layout = self.copies.settings.layout
        how = (f"ring, offset {layout.offset}" if layout.mode == ring.RING
               else f"cliques of {layout.clique_size} nodes")
        return f"{how}, across {self.nodes} nodes"

    def offer(self, sealed: store.Sealed, world_size: int) -> None:
        """A sealed snapshot of this rank: to its holders, in the background."""
        if self.copies is not None and not self.copies.off_reason:
            self.copies.offer(SnapshotFile(sealed.rank, sealed.step, world_size, sealed.digest,
                                           sealed.path))

    def offer_part(self, sealed: store.Sealed, world_size: int) -> None:
        """This rank's sealed part of a step (rank_parts.py): to its holders, so a node
        whose every rank died still has each rank's RNGs and data position of it."""
        if self.copies is not None and not self.copies.off_reason:
            self.copies.offer_part(SnapshotFile(sealed.rank, sealed.step, world_size,
                                                sealed.digest, sealed.path))

    def after_resume(self, step: int | None) -> None:
        """The job resumed at ``step`` (None: from scratch): copies of the lost history go.
        A world on one node (what a lost node left) keeps no copies: its receiver closes."""
        if self.copies is None:
            return
        self.copies.after_resume(step)
        if self.copies.off_reason:
            self.close()

    def refresh(self) -> None:
        """The status's ``peer_copies``: copies sent, held, skipped, and the holders."""
        copies = self.copies
        if copies is None:
            return
        stats = copies.stats()
        sender, received = stats["sender"], stats["receiver"]
        counts = sender["counts"]
        holders = sender["holders"]
        stored = [h["stored_step"] for h in holders.values()]
        self.facts = {
            "enabled": not copies.off_reason, "off_reason": copies.off_reason or None,
            "mode": copies.settings.layout.mode,
            "holders": [{"rank": r, "node": copies.node_names[r]} for r in holders],
            "holding": stats["holding"],
            "sent_total": counts.get("stored", 0), "failed_total": counts.get("failed", 0),
            "skipped_total": sum(counts.get(k, 0) for k in SKIPPED),
            "held_step": min(stored) if stored and None not in stored else None,
            "last_error": next((h["last_error"] for h in holders.values() if h["last_error"]),
                               None),
            "received_total": received.get("stored", 0),
            "received_refused_total": sum(received.get(k, 0) for k in REFUSED),
            "parts_sent_total": stats["part_sender"]["counts"].get("stored", 0),
            "parts_dropped_total": sum(stats["part_sender"]["counts"].get(k, 0)
                                       for k in ("dropped", *SKIPPED, "failed")),
            "parts_held_total": received.get("part_stored", 0),
            "sender": counts, "receiver": received}

    def close(self, finished: bool = False) -> None:
        """Stop sending and receiving (a push under way is not waited for); after the run's
        last step, the node's copies go too: nothing is left to resume."""
        self.refresh()  # the last counts stay in the status
        copies, self.copies = self.copies, None
        if copies is not None:
            copies.sender.close(CLOSE_WAIT_S)
            copies.receiver.close()
            if finished:
                for folder in (HELD_DIR, HELD_PARTS_DIR, FETCHED_DIR):
                    shutil.rmtree(copies.root / folder, ignore_errors=True)
