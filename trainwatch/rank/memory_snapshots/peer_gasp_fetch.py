"""A node with no survivor resumes from another node's gasp and its ranks' held parts.

peer_gasp.py resumes a multi-node job from a gasp step only where every node holds the step
whole among its own ranks. When every rank of a node died at once there is no survivor on
it to gasp: its ranks' newest whole state is their last snapshot, although another node's
survivors gasped step N and (peer_copies.py, ``offer_part``) hold each lost rank's part of
N (its RNGs and data position). Data-parallel state is the same on every replica, so here a
step counts when ANY rank holds it whole and EVERY rank's part of it is somewhere: on its
own node, or held for it by its peer. What a rank lacks on its node is sent to it over the
peer link (``FETCH``, authenticated and verified as the exchange's transfers are); when
any transfer fails no rank uses the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwatch.rank.checkpoint.resume import Restored
from trainwatch.rank.memory_snapshots import gasp_resume, rank_parts, store
from trainwatch.rank.memory_snapshots import resume as local
from trainwatch.rank.memory_snapshots.dying_gasp import gasp_folder
from trainwatch.rank.memory_snapshots.peer_copies import PeerCopies
from trainwatch.rank.memory_snapshots.peer_store import SnapshotFile

log = logging.getLogger(__name__)

WHOLE = ("gasp", "own")              # files with the model and optimizer
PARTS = ("part", "held_part")   # a rank's own part alone (torch.save'd, rank_parts.py)


@dataclass(frozen=True)
class Offer:
    """A file rank ``holder`` can read on its node: ``rank``'s ``kind`` of ``step``."""

    holder: int
    kind: str
    rank: int
    step: int
    digest: str
    path: str
    sealed_at: float


@dataclass(frozen=True)
class Choice:
    step: int
    shared: list[Offer]               # per rank: where its model and optimizer come from
    part: list[Offer | None]          # per rank: its own part (None: in ``shared``)
    newest: int


def offers_here(snaps: Any, copies: PeerCopies) -> list[Offer]:
    """This rank's gasps, snapshots and parts, and the parts it holds for other ranks,
    of this world size and config."""
    root, me, world, config = snaps.root, snaps.rank, snaps.world_size, snaps.config_hash
    found: list[tuple[str, int, store.Sealed]] = []
    for kind, folder in (("gasp", gasp_folder(root, me)), ("own", store.rank_folder(root, me)),
                         ("part", rank_parts.parts_folder(root, me))):
        found += [(kind, me, s) for s in store.sealed(folder)]
    for held in copies.holding:
        for copy in copies.receiver.parts.copies(held):
            try:
                found.append(("held_part", held, store.sealed_file(copy.snapshot.path)))
            except store.Rejected:
                continue
    return [Offer(me, kind, s.rank, s.step, s.digest, str(s.path), s.sealed_at or 0.0)
            for kind, rank, s in found
            if s.rank == rank and s.world_size == world and s.config_hash == config]


def choose(offers: list[list[Offer]], node_of: list[int], floor: int,
           excluded: frozenset[int], rollback_at: float | None) -> Choice | None:
    """The newest step above ``floor`` that a file somewhere holds whole and every rank's
    part of which is somewhere; files on a rank's own node first. Pure: every rank alike."""
    usable = [o for per in offers for o in per if o.step > floor and o.step not in excluded
              and (rollback_at is None or o.sealed_at >= rollback_at)]
    world = len(offers)

    def near(rank: int, options: list[Offer]) -> Offer | None:
        here = [o for o in options if node_of[o.holder] == node_of[rank]]
        return min(here or options, key=lambda o: (o.rank != rank, o.holder), default=None)

    for step in sorted({o.step for o in usable if o.kind in WHOLE}, reverse=True):
        whole = [o for o in usable if o.step == step and o.kind in WHOLE]
        shared, part = [], []
        for rank in range(world):
            src = near(rank, whole)
            assert src is not None
            own = None if src.rank == rank else near(rank, [
                o for o in usable if o.step == step and o.rank == rank and o.kind in PARTS])
            if src.rank != rank and own is None:
                break
            shared.append(src)
            part.append(own)
        else:
            return Choice(step, shared, part, max(o.step for o in usable))
    return None


def resume(snaps: Any, copies: PeerCopies, floor: int, excluded: frozenset[int],
           rollback_at: float | None) -> tuple[Restored | None, str]:
    """Every rank (collective): the chosen step loaded, files sent where a rank's node
    lacks them; or None and why not."""
    try:
        mine = offers_here(snaps, copies)
    except Exception as exc:  # never out of a collective: this rank offers nothing
        log.warning("trainwatch memory snapshots: cannot list the gasp files: %s", exc)
        mine = []
    offers = copies.collective.all_gather(mine)
    chosen = choose(offers, copies.node_of, floor, excluded, rollback_at)
    if chosen is None:
        return None, "no rank's part of a gasp step is on its node or its peer"
    me = copies.rank
    needs = [(r, o) for r in range(copies.world_size) for o in (chosen.shared[r], chosen.part[r])
             if o is not None and copies.node_of[o.holder] != copies.node_of[r]]
    for rank, offer in needs:
        if rank == me:
            copies.receiver.expect(offer.rank, offer.step, offer.digest)
    copies.collective.all_gather(None)   # every rank expects before any file goes
    problem = None
    for rank, offer in needs:
        if offer.holder == me:
            answer = _push(copies, rank, offer, snaps.world_size)
            problem = problem or (None if answer == "stored" else
                                  f"{offer.kind} of rank {offer.rank} to rank {rank}: {answer}")
    arrived = copies.receiver.wait_fetched(copies.settings.fetch_timeout_s) if any(
        r == me for r, _ in needs) else {}
    restored = None
    if problem is None:
        restored, problem = _load(chosen, me, arrived, snaps.world_size, copies.node_of)
    problems = copies.collective.all_gather(problem)
    bad = {r: p for r, p in enumerate(problems) if p is not None}
    copies.release_fetched()
    if bad or restored is None:
        first = min(bad) if bad else me
        return None, f"step {chosen.step}: rank {first}: {bad.get(first)}"
    restored.manifest.update(source=gasp_resume.SOURCE, newest_step=chosen.newest,
                             steps_lost=chosen.newest - chosen.step,
                             state_of_rank=chosen.shared[0].rank, transfers=len(needs))
    return restored, (f"every rank can restore step {chosen.step}: the model and optimizer of "
                      f"rank {chosen.shared[0].rank}'s {chosen.shared[0].kind}, each rank's own "
                      f"part ({len(needs)} files sent between nodes)")


def _push(copies: PeerCopies, to: int, offer: Offer, world: int) -> str:
    try:
        return copies.push(to, SnapshotFile(offer.rank, offer.step, world, offer.digest,
                                            Path(offer.path)))
    except Exception as exc:  # a failed transfer: no rank uses the step
        return f"{type(exc).__name__}: {exc}"


def _load(chosen: Choice, me: int, arrived: dict[int, Any], world: int,
          node_of: list[int]) -> tuple[Restored | None, str | None]:
    """This rank's model and optimizer and its own part, from its node or what arrived."""
    def path(offer: Offer) -> Path:
        if node_of[offer.holder] == node_of[me]:
            return Path(offer.path)
        if offer.rank not in arrived:
            raise store.Rejected(f"rank {offer.rank}'s {offer.kind} did not arrive")
        return Path(arrived[offer.rank].snapshot.path)

    shared, part = chosen.shared[me], chosen.part[me]
    try:
        restored, problem = local.load_file(path(shared), chosen.step, world)
        if restored is None or part is None:
            return restored, problem
        restored.rank_state = gasp_resume.read_part(path(part))
    except Exception as exc:  # a torn or altered file: the step is not used
        return None, f"step {chosen.step}: {exc}"
    return restored, None
