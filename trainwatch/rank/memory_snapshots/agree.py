"""At a resume, the ranks agree on the newest step whose snapshot every rank has.

``newest_common`` is the rule, a pure function of what each rank found (``Found``): the
newest step in every rank's list, sealed after the last rollback (a rollback resumes
before a bad step on purpose: a snapshot taken before it would undo that), and newer than
the durable checkpoint (else that checkpoint is as good and outlives the node). ``gather``
is the collective that brings every rank's ``Found`` to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

# The controller's actions that resume before the newest step on purpose (control/actions.py
# ROLLBACKS; the rank library does not import the control component).
ROLLBACK_ACTIONS = ("rollback_skip", "replica_rollback")


@dataclass
class Found:
    """What one rank has: its sealed steps (step -> sealed_at) and, from rank 0, the newest
    durable checkpoint step and the time of the last rollback."""

    rank: int
    steps: dict[int, float] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # files not usable, with the reason
    # data-parallel state (dying_gasp.py): its dying gasps and its own parts (RNGs, data
    # position) of the steps between snapshots, step -> sealed_at
    gasps: dict[int, float] = field(default_factory=dict)
    parts: dict[int, float] = field(default_factory=dict)
    durable_step: int | None = None
    rollback_at: float | None = None


@dataclass
class Agreed:
    step: int | None      # the snapshot step to resume from; None: the durable checkpoint
    reason: str           # why (journaled)


def newest_common(found: list[Found], excluded: frozenset[int] = frozenset()) -> Agreed:
    """The newest step every rank can resume from, or None and why not."""
    if not found:
        return Agreed(None, "no ranks")
    first = found[0]
    usable = []
    for f in found:
        steps = {s for s, at in f.steps.items() if s not in excluded and (
            first.rollback_at is None or (at or 0) >= first.rollback_at)}
        usable.append(steps)
    if not any(usable):
        stale = any(f.steps for f in found)
        if stale and first.rollback_at is not None:
            return Agreed(None, "every snapshot predates the last rollback")
        refused = [(f.rank, f.refused[0]) for f in found if f.refused]
        return Agreed(None, f"no rank has a usable snapshot (rank {refused[0][0]}: "
                            f"{refused[0][1]})" if refused else "no rank has a snapshot")
    common = set.intersection(*usable)
    if not common:
        newest = {f.rank: max(s) if s else None for f, s in zip(found, usable)}
        missing = [r for r, s in newest.items() if s is None]
        text = (f"rank {missing[0]} has none" if missing else
                "no step every rank has (newest per rank: "
                + ", ".join(f"{r}: {s}" for r, s in list(newest.items())[:8]) + ")")
        return Agreed(None, text)
    step = max(common)
    if first.durable_step is not None and step <= first.durable_step:
        return Agreed(None, f"snapshot step {step} is not newer than the durable checkpoint "
                            f"(step {first.durable_step})")
    return Agreed(step, f"every rank has step {step}"
                  + (f", newer than the durable checkpoint (step {first.durable_step})"
                     if first.durable_step is not None else ", and no durable checkpoint"))


def gather(mine: Any, group: Any, world_size: int) -> list[Any]:
    """Every rank's ``mine``, in rank order (one rank: its own)."""
    if group is None:
        return [mine]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, mine, group=group)
    return out
