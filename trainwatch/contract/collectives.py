"""Who waits in which process group's collective, and who never entered it: once, torch-free.

Every process group numbers its collectives 1, 2, 3, ... on every rank alike. A rank's
progress in a group is two counters: the newest collective it enqueued and the newest that
completed; enqueued > completed means it is inside collective #enqueued now. Across the
ranks of a group, the frontier is the highest number any enqueued: ranks at the frontier
still in it wait there; ranks below it never entered it (they are ``behind``).

``diagnose`` reads these counters from the ranks' flight-recorder dumps, the agent from
the ranks' beat files (``collectives``, written by ``trainwatch/rank/collective_progress.py``,
docs/run-directory.md): both decide with the functions here, so both name the same rank.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

# The beat carries at most this many groups: those the rank is inside a collective of, then
# the most recently active (a job has a handful; FSDP, tensor and pipeline parallelism a
# few dozen). A group name longer than MAX_NAME (DeviceMesh's are 40-digit hashes) is
# shortened the same way on every rank.
MAX_GROUPS = 32
MAX_NAME = 24


def beat_field(progress: Mapping[str, tuple[int, int]]) -> dict[str, list[int]]:
    """The beat's ``collectives`` field: {group: [enqueued, completed]}, in the given order
    (most relevant first: a record short of room drops the tail), at most MAX_GROUPS."""
    field: dict[str, list[int]] = {}
    for name, (enqueued, completed) in list(progress.items())[:MAX_GROUPS]:
        field[short_name(name)] = [enqueued, completed]
    return field


def short_name(name: str) -> str:
    """A group's name as the beat carries it: itself, or a digest of a long one."""
    if len(name) <= MAX_NAME:
        return name
    return "#" + hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:16]


def read_field(value: Any) -> dict[str, tuple[int, int]] | None:
    """A beat's ``collectives`` as {group: (enqueued, completed)}; None when it carries none
    or it is malformed (a reader must not trust a file: the whole field or nothing)."""
    if not isinstance(value, dict) or len(value) > MAX_GROUPS:
        return None
    out = {}
    for name, pair in value.items():
        if not (isinstance(name, str) and len(name) <= MAX_NAME and isinstance(pair, list)
                and len(pair) == 2 and all(_count(n) for n in pair)):
            return None
        out[name] = (pair[0], pair[1])
    return out


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and -1 <= n < 2**63


def in_collective(enqueued: int, completed: int | None) -> bool:
    """Inside collective #enqueued: enqueued and not completed."""
    return enqueued > 0 and (completed is None or completed < enqueued)


def who_waits(counters: Mapping[int, tuple[int, int | None]]) -> dict[str, Any]:
    """One group's ranks by their counters {rank: (enqueued, completed)}: the ``frontier``
    (the newest collective any rank enqueued), the ranks ``waiting`` in it, and the ranks
    ``behind`` it (never entered it), each with its last collective there and whether it is
    still inside that one (``in_collective``)."""
    frontier = max(enqueued for enqueued, _ in counters.values())
    waiting, behind = [], {}
    for rank, (enqueued, completed) in sorted(counters.items()):
        if enqueued == frontier:
            if completed is None or completed < frontier:
                waiting.append(rank)
        else:
            behind[rank] = {"last_enqueued": enqueued, "last_completed": completed,
                            "in_collective": completed is not None and completed < enqueued}
    return {"frontier": frontier, "waiting": waiting, "behind": behind}


def by_group(progress: Mapping[int, Mapping[str, tuple[int, int]]]) -> dict[str, dict[str, Any]]:
    """``who_waits`` of every group from each rank's progress {rank: {group: counters}}; a
    group is judged over the ranks that report it."""
    groups: dict[str, dict[int, tuple[int, int]]] = {}
    for rank, mine in progress.items():
        for name, counters in mine.items():
            groups.setdefault(name, {})[rank] = counters
    return {name: who_waits(counters) for name, counters in sorted(groups.items())}


def crossed_waits(analysed: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Ranks that wait in different groups' collectives, each for the other side.

    Some ranks wait in group h's newest collective that the others never entered, because
    those others went on to group g's next collective, which the first ones never entered:
    one side skipped a collective (or issued an extra one). The smaller side is the odd one
    out (``culprits``); with equal sides it cannot be told (``tie``). Each entry names the
    collective the culprits did not enter (``group``, ``seq``, ``op`` when known,
    ``waiting``) and the one they wait in instead (``waits_in``).
    """
    found, seen = [], set()
    for h, gh in analysed.items():
        for g, gg in analysed.items():
            if g == h:
                continue
            # ``waiting`` sit in h's newest collective and never entered g's; ``missing``
            # completed all they entered in h and sit in g's newest.
            waiting = sorted(r for r in gh["waiting"] if r in gg["behind"]
                             and not gg["behind"][r]["in_collective"])
            missing = sorted(r for r in gg["waiting"] if r in gh["behind"]
                             and not gh["behind"][r]["in_collective"])
            key = frozenset((h, g))
            if not waiting or not missing or key in seen or len(missing) > len(waiting):
                continue
            seen.add(key)
            found.append({"group": h, "seq": gh["frontier"], "op": gh.get("frontier_op"),
                          "waiting": waiting, "culprits": missing,
                          "tie": len(missing) == len(waiting),
                          "waits_in": {"group": g, "seq": gg["frontier"],
                                       "op": gg.get("frontier_op")}})
    return found


def never_entered(analysed: Mapping[str, Mapping[str, Any]],
                  busy: set[int]) -> list[dict[str, Any]]:
    """Ranks inside no collective (not in ``busy``) that are behind a group's frontier while
    others wait in it: the others wait for them. One entry per group: the collective
    (``group``, ``seq``), who wait in it and who never entered it (``culprits``)."""
    found = []
    for name, g in analysed.items():
        missing = sorted(r for r, b in g["behind"].items() if r not in busy)
        if g["waiting"] and missing:
            found.append({"group": name, "seq": g["frontier"], "waiting": g["waiting"],
                          "culprits": missing})
    return found
