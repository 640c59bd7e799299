"""Peer copies for one rank: set up with the job at start, then fed one snapshot per step.

Interface (the snapshotter's side; docs/memory-snapshots.md, "Peer copies"):

    copies = PeerCopies.start(root)      # collective: every rank, once, after init_process_group
    outcome = fetch_newest_common(copies, own_snapshots)   # peer_fetch.py, at resume
    copies.release_fetched()             # once outcome.resume.snapshot is loaded
    copies.offer(SnapshotFile(...))      # each sealed snapshot; returns at once
    copies.offer_part(SnapshotFile(...)) # each step's own part (rank_parts.py); at once
    copies.stats()                       # for the status: holders, counts, why off
    copies.close()

``start`` gathers every rank's node name and receiver address over the job's process group
(``all_gather_object``), and rank 0's fresh job-wide secret (``broadcast_object_list``):
the secret only ever travels there, never in a file, a log or the environment. A one-node
job (or a layout that would keep a copy on its own node) gets no sender and says why in
``off_reason``; its receiver still serves the resume exchange.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainwatch.contract.env import PEER_ADDR_ENV
from trainwatch.contract.layout import rank_file_name
from trainwatch.contract.ports import LOOPBACK
from trainwatch.node import node_name
from trainwatch.rank.memory_snapshots import peer_ring as ring
from trainwatch.rank.memory_snapshots import peer_wire as wire
from trainwatch.rank.memory_snapshots.peer_receiver import RESERVE_BYTES, PeerReceiver
from trainwatch.rank.memory_snapshots.peer_sender import PeerSender
from trainwatch.rank.memory_snapshots.peer_store import PeerStore, SnapshotFile, secure_dir

HELD_DIR = "held"
HELD_PARTS_DIR = "held-parts"   # the held ranks' per-step parts (RNGs, data position)
FETCHED_DIR = "fetched"


class PeerStartError(Exception):
    """A rank could not start its receiver (every rank raises it alike); ``str()`` says
    which rank and why."""


class Collective(Protocol):
    """The two collectives peer copies need (the job's process group in a real job)."""

    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...

    def broadcast(self, obj: Any) -> Any: ...


class TorchCollective:
    """``Collective`` over a torch.distributed process group (default: the job's)."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self._dist, self._group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


@dataclass(frozen=True)
class PeerSettings:
    layout: ring.PeerLayout = field(default_factory=ring.PeerLayout)
    keep: int = 2                  # copies kept per held rank, the arriving one counted
    timeout_s: float = 10.0        # any one socket operation; a dead peer costs no more
    reserve_bytes: int = RESERVE_BYTES
    fetch_timeout_s: float = 120.0  # the whole resume exchange's transfers


def peer_host(env: Any = os.environ) -> str:
    """The address this rank's receiver listens on: ``$TRAINWATCH_PEER_ADDR``, else the
    local address of the route towards ``MASTER_ADDR`` (the interface the job's own traffic
    uses; loopback when the master is local), else the hostname's address."""
    explicit = env.get(PEER_ADDR_ENV)
    if explicit:
        return str(explicit)
    master = env.get("MASTER_ADDR")
    try:
        if master:
            family, _, _, _, sockaddr = socket.getaddrinfo(master, None, proto=socket.IPPROTO_TCP)[0]
            if ipaddress.ip_address(sockaddr[0]).is_loopback:
                return LOOPBACK
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((sockaddr[0], 9))  # no packet: only picks the route
                return str(probe.getsockname()[0])
        return socket.gethostbyname(socket.gethostname())
    except (OSError, ValueError, IndexError):
        return LOOPBACK


class SoloCollective:
    """``Collective`` of a job of one rank (no process group needed)."""

    rank, world_size = 0, 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj


class PeerCopies:
    def __init__(self, root: Path, collective: Collective, settings: PeerSettings,
                 secret: bytes, receiver: PeerReceiver, infos: list[dict[str, Any]],
                 started_ns: int):
        self.root, self.collective, self.settings = root, collective, settings
        self.started_ns = started_ns  # copies received before: an earlier attempt's
        self.rank, self.world_size = collective.rank, collective.world_size
        self._secret, self.receiver = secret, receiver
        self.endpoints = [wire.Endpoint(r, i["host"], i["port"]) for r, i in enumerate(infos)]
        self.node_names = [str(i["node"]) for i in infos]
        if settings.layout.nodes == ring.BY_NAMES:
            self.node_of = ring.nodes_from_names(self.node_names)
        else:
            self.node_of = ring.nodes_from_blocks(self.world_size, int(infos[0]["local_world_size"]))
        self.off_reason = ""
        try:
            self.holders = ring.holders(settings.layout, self.node_of)
        except ring.NoPeerCopies as exc:
            self.holders, self.off_reason = {}, str(exc)
        self.holding = ring.held_by(self.holders, self.rank)
        receiver.hold(set(self.holding))
        receiver.fetched.retain(set())  # a snapshot an earlier attempt fetched: stale now
        collective.all_gather(None)     # every receiver knows what it holds before a copy goes
        mine = [self.endpoints[h] for h in self.holders.get(self.rank, [])]
        self.sender = PeerSender(self.rank, mine, secret, timeout=settings.timeout_s).start()
        # a few KB a step on a sender of its own: a snapshot's transfer never holds it up
        self.part_sender = PeerSender(self.rank, mine, secret, timeout=settings.timeout_s,
                                      kind=wire.PART).start()

    def __repr__(self) -> str:  # never the secret
        return (f"PeerCopies(rank={self.rank}, holders={self.holders.get(self.rank, [])}, "
                f"holding={self.holding}, off={self.off_reason!r})")

    @classmethod
    def start(cls, root: str | Path, settings: PeerSettings | None = None,
              collective: Collective | None = None, host: str | None = None) -> "PeerCopies":
        """Collective: every rank of the job calls it once, after the process group is up."""
        started_ns = time.time_ns()  # before any rank of this attempt can send a copy
        settings = settings or PeerSettings()
        collective = collective or TorchCollective()
        secret = collective.broadcast(wire.new_secret() if collective.rank == 0 else None)
        receiver: PeerReceiver | None = None
        try:  # a rank that cannot start must still join the gather, or the others would hang
            root = secure_dir(Path(root))
            for folder in (HELD_DIR, HELD_PARTS_DIR, FETCHED_DIR):
                secure_dir(root / folder)
            receiver = PeerReceiver(host or peer_host(), secret, collective.rank,
                                    PeerStore(root / HELD_DIR),
                                    PeerStore(root / FETCHED_DIR / rank_file_name(collective.rank, "")),
                                    keep=settings.keep, reserve_bytes=settings.reserve_bytes,
                                    timeout=settings.timeout_s,
                                    parts=PeerStore(root / HELD_PARTS_DIR)).start()
            mine: dict[str, Any] = {
                "node": node_name(), "host": receiver.host, "port": receiver.port,
                "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
        except (OSError, ValueError) as exc:
            mine = {"error": str(exc)[:300]}
        infos = collective.all_gather(mine)
        failed = [(r, i["error"]) for r, i in enumerate(infos) if "error" in i]
        if failed:  # the same answer on every rank: no peer copies for this job
            if receiver is not None:
                receiver.close()
            raise PeerStartError(f"rank {failed[0][0]}: {failed[0][1]}")
        assert receiver is not None
        return cls(Path(root), collective, settings, secret, receiver, infos, started_ns)

    @property
    def held(self) -> PeerStore:
        return self.receiver.held

    def offer(self, snapshot: SnapshotFile) -> None:
        """This rank's newest sealed snapshot: pushed to its holders in the background."""
        self.sender.offer(snapshot)

    def offer_part(self, part: SnapshotFile) -> None:
        """This rank's part of its newest step: pushed to its holders in the background;
        one that a slow link has not sent yet is replaced and counted (``dropped``)."""
        self.part_sender.offer(part)

    def push(self, to_rank: int, snapshot: SnapshotFile) -> str:
        """At resume: send ``snapshot`` to ``to_rank``, which expects it; the answer."""
        header = {"kind": wire.FETCH, "from_rank": self.rank, "to_rank": to_rank,
                  "rank": snapshot.rank, "step": snapshot.step,
                  "world_size": snapshot.world_size, "digest": snapshot.digest}
        return wire.push_file(self.endpoints[to_rank], self._secret, header, snapshot.path,
                              self.settings.timeout_s)

    def after_resume(self, step: int | None) -> None:
        """The job resumes at ``step`` (from memory or the durable checkpoint; None: from
        scratch): copies of later steps belong to the history that was lost, and ranks the
        new layout does not give this node take memory for nothing. Call it before the
        first ``offer`` (``fetch_newest_common`` does when it finds a step)."""
        if not self._lowest_local_rank():  # the node's held folder is shared: one tidies
            return
        parts = self.receiver.parts
        if step is None:
            self.held.retain(set())
            parts.retain(set())
            return
        kept = {r for rank in self._node_ranks() for r in ring.held_by(self.holders, rank)}
        for held in (self.held, parts):
            held.discard_newer_than(step, received_before_ns=self.started_ns)
            held.retain(kept)

    def _node_ranks(self) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == self.node_of[self.rank]]

    def _lowest_local_rank(self) -> bool:
        """One rank per node tidies the node's shared ``held`` folder."""
        return self._node_ranks()[0] == self.rank

    @property
    def fetched(self) -> PeerStore:
        """This rank's snapshot at resume when it was sent or held on its node."""
        return self.receiver.fetched

    def release_fetched(self) -> None:
        """The resumed snapshot is loaded: its memory goes back."""
        self.fetched.retain(set())

    def stats(self) -> dict[str, Any]:
        return {"off_reason": self.off_reason, "holders": self.holders.get(self.rank, []),
                "holding": self.holding, "sender": self.sender.stats(),
                "part_sender": self.part_sender.stats(),
                "receiver": self.receiver.stats()}

    def close(self) -> None:
        self.part_sender.close()
        self.sender.close()
        self.receiver.close()
