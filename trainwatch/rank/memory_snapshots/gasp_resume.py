"""Resume data-parallel state from the newest step every rank can restore.

Data-parallel (not sharded) state is the same model and optimizer on every rank, so a step
can be restored when ANY rank has a whole snapshot of it (its own of the cadence, or its
dying gasp, dying_gasp.py) and EVERY rank has its own part of it: its RNGs and data
position, in its own snapshot, its gasp, or its per-step part (rank_parts.py). ``plan`` is
that rule, a pure function of every rank's ``Found``; ``load`` reads a rank's share. The
rules of the snapshots hold: nothing sealed before the last rollback, nothing not newer
than the durable checkpoint. A rank reads the whole file of a replica on its own node (the
ranks of a node share its /dev/shm): on several nodes (``node_of``), each node needs a whole
copy of the step among its own ranks; peer_gasp.py runs the rule before the peer exchange.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainwatch.rank.checkpoint.resume import Restored
from trainwatch.rank.memory_snapshots import rank_parts, store
from trainwatch.rank.memory_snapshots.agree import Found
from trainwatch.rank.memory_snapshots.dying_gasp import gasp_folder

SOURCE = "dying gasp"    # state_from when a rank's model came from a gasp or a replica
OWN, GASP, PART = "own", "gasp", "part"
JOURNALED = ("state_of_rank",)   # checkpoint_resumed's: whose model and optimizer (rank 0's)


@dataclass
class Plan:
    step: int
    # per rank: (where its model and optimizer come from: (rank, OWN|GASP), and whether
    # its RNGs and data position come from its part)
    shared_from: list[tuple[int, str]]
    from_part: list[bool]
    newest_step: int
    reason: str

    @property
    def gasped(self) -> bool:
        return any(kind == GASP or r != i for i, (r, kind) in enumerate(self.shared_from))


def found_parts(found: Found, root: Path, rank: int, world_size: int,
                config_hash: str | None) -> None:
    """Add this rank's gasps and parts of this world size and config to ``found``."""
    for into, folder in ((found.gasps, gasp_folder(root, rank)),
                         (found.parts, rank_parts.parts_folder(root, rank))):
        for s in store.sealed(folder):
            if s.rank == rank and s.world_size == world_size and s.config_hash == config_hash:
                into[s.step] = s.sealed_at or 0.0


def plan(found: list[Found], excluded: frozenset[int], beat: int | None,
         node_of: list[int] | None = None) -> Plan | None:
    """The newest step every rank can restore, newer than ``beat`` (the step every rank has
    a snapshot of, None: none) and than the durable checkpoint; None when there is none.
    ``node_of``: each rank's node (None: one node); a rank's model and optimizer come
    from a file on its own node."""
    first = found[0]
    node_of = node_of or [0] * len(found)

    def usable(steps: dict[int, float]) -> set[int]:
        return {s for s, at in steps.items() if s not in excluded and (
            first.rollback_at is None or (at or 0) >= first.rollback_at)}

    own = [usable(f.steps) for f in found]
    gasps = [usable(f.gasps) for f in found]
    parts = [usable(f.parts) for f in found]
    whole_on: dict[int, set[int]] = {}
    for i, node in enumerate(node_of):
        whole_on.setdefault(node, set()).update(own[i], gasps[i])
    restorable = set.intersection(*(whole_on[node_of[i]] & (o | g | p) for i, (o, g, p)
                                    in enumerate(zip(own, gasps, parts))))
    floor = max(x for x in (beat, first.durable_step, -1) if x is not None)
    newer = [s for s in restorable if s > floor]
    if not newer:
        return None
    step = max(newer)

    def donor(node: int) -> tuple[int, str]:
        here = [r for r, n in enumerate(node_of) if n == node]
        return next(((r, GASP) for r in here if step in gasps[r]), None) or next(
            (r, OWN) for r in here if step in own[r])

    shared_from = [(i, OWN) if step in own[i] else (i, GASP) if step in gasps[i]
                   else donor(node_of[i]) for i in range(len(found))]
    from_part = [step not in own[i] and step not in gasps[i] for i in range(len(found))]
    newest = max(set().union(*own, *gasps, *parts))
    named = donor(node_of[0]) if len(set(node_of)) == 1 else None
    whose = (f"rank {named[0]}'s {'dying gasp' if named[1] == GASP else 'snapshot'}"
             if named else "a replica on each rank's node")
    return Plan(step, shared_from, from_part, newest,
                f"every rank can restore step {step} (the model and optimizer of {whose}, "
                "each rank's own RNGs and data position)" + (
                    f", newer than the durable checkpoint (step {first.durable_step})"
                    if first.durable_step is not None else ", and no durable checkpoint"))


def file_of(root: Path, rank: int, kind: str, step: int) -> Path:
    folder = gasp_folder(root, rank) if kind == GASP else store.rank_folder(root, rank)
    return folder / store.snapshot_name(step)


def load(root: Path, rank: int, chosen: Plan, world_size: int,
         load_file: Any) -> tuple[Restored | None, str | None]:
    """This rank's share of ``chosen``: the whole snapshot it names, and its own part."""
    source_rank, kind = chosen.shared_from[rank]
    restored, problem = load_file(file_of(root, source_rank, kind, chosen.step),
                                  chosen.step, world_size)
    if restored is None:
        return None, problem
    if chosen.from_part[rank]:
        path = rank_parts.parts_folder(root, rank) / store.snapshot_name(chosen.step)
        try:
            restored.rank_state = read_part(path)
        except Exception as exc:  # a torn or altered part: the ranks try an older step
            return None, f"{path.name}: {exc}"
    restored.manifest.update(source=SOURCE if chosen.gasped else restored.manifest["source"],
                             newest_step=chosen.newest_step,
                             steps_lost=chosen.newest_step - chosen.step,
                             state_of_rank=source_rank)
    return restored, None


def read_part(path: Path) -> dict[str, Any]:
    """A rank's part (RNGs, data position) from a sealed part, gasp or snapshot file of
    the store's ``torch.save`` format, its digest checked."""
    header = store.read_header(path)
    data = store.payload(path)
    digest = store.hasher(header)
    digest.update(data)
    if digest.hexdigest() != header["digest"]:
        raise store.Rejected("digest mismatch: the payload is not what was sealed")
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return dict(state["rank"])
