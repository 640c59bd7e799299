"""Which ranks the others wait for, and where the collective sequences disagree.

Per process group: the frontier is the highest collective sequence number any
rank has enqueued. Ranks in flight at the frontier are waiting; ranks below it
are missing from the collective the others wait in. A mismatch is the first
sequence number at which ranks issued different ops, sizes or dtypes (a desync).
"""

from __future__ import annotations

import statistics
from typing import Any

LATENESS_WINDOW = 50


def analyse(groups: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {pg: analyse_group(group) for pg, group in groups.items() if group["per_rank"]}


def analyse_group(group: dict[str, Any]) -> dict[str, Any]:
    per_rank: dict[int, dict[str, Any]] = group["per_rank"]
    frontier = max(v["last_enqueued"] for v in per_rank.values())
    waiting, behind = [], {}
    for rank, view in sorted(per_rank.items()):
        done = view.get("last_completed")
        if view["last_enqueued"] == frontier:
            if done is None or done < frontier:
                waiting.append(rank)
        else:
            behind[rank] = {"last_enqueued": view["last_enqueued"], "last_completed": done,
                            "in_collective": done is not None and done < view["last_enqueued"]}
    frontier_op = next((describe(per_rank[r]["entries"].get(frontier)) for r in waiting
                        if per_rank[r]["entries"].get(frontier)), None)
    return {"desc": group.get("desc"), "ranks": sorted(per_rank), "frontier": frontier,
            "frontier_op": frontier_op, "waiting": waiting, "behind": behind,
            "mismatch": first_mismatch(per_rank), "lateness": lateness(per_rank)}


def signature(entry: dict[str, Any]) -> tuple[Any, ...]:
    return (entry.get("op"), repr(entry.get("sizes")), repr(entry.get("dtypes")))


def describe(entry: dict[str, Any] | None) -> str | None:
    if not entry:
        return None
    dtypes = ",".join(entry.get("dtypes") or [])
    return f"{entry.get('op')} sizes={entry.get('sizes')} dtype={dtypes}"


def first_mismatch(per_rank: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The lowest sequence number seen by ≥ 2 ranks whose entries differ."""
    seqs = sorted({s for v in per_rank.values() for s in v["entries"]})
    for seq in seqs:
        present = {r: v["entries"][seq] for r, v in per_rank.items() if seq in v["entries"]}
        if len(present) >= 2 and len({signature(e) for e in present.values()}) > 1:
            return {"seq": seq, "ops": {r: describe(e) for r, e in sorted(present.items())},
                    "frames": {r: e.get("frames", []) for r, e in sorted(present.items())},
                    "novel": novel(per_rank, present, seq)}
    return None


def novel(per_rank: dict[int, dict[str, Any]], present: dict[int, dict[str, Any]],
          seq: int) -> list[int]:
    """Ranks whose op at ``seq`` they never issued before: likely the extra collective."""
    return sorted(r for r, e in present.items()
                  if all(signature(old) != signature(e)
                         for s, old in per_rank[r]["entries"].items() if s < seq))


def lateness(per_rank: dict[int, dict[str, Any]]) -> dict[int, float]:
    """Median seconds each rank entered collectives after the earliest rank (same clock assumed)."""
    if len(per_rank) < 2:
        return {}
    common = set.intersection(*(set(v["entries"]) for v in per_rank.values()))
    late: dict[int, list[float]] = {r: [] for r in per_rank}
    for seq in sorted(common)[-LATENESS_WINDOW:]:
        created = {r: v["entries"][seq].get("created_ns") for r, v in per_rank.items()}
        if not all(isinstance(t, int) for t in created.values()):
            continue
        first = min(created.values())
        for rank, t in created.items():
            late[rank].append((t - first) / 1e9)
    return {r: round(statistics.median(v), 4) for r, v in late.items() if v}


def crossed_waits(analysed: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks that wait in different groups' collectives, each for the other side.

    Some ranks wait in group h's newest collective that the others never entered, because
    those others went on to group g's next collective, which the first ones never entered:
    one side skipped a collective (or issued an extra one). The smaller side is the odd one
    out (``culprits``); with equal sides it cannot be told (``tie``). Each entry names the
    collective the culprits did not enter (``group``, ``seq``, ``op``, ``waiting``) and
    the one they wait in instead (``waits_in``).
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
            found.append({"group": h, "seq": gh["frontier"], "op": gh["frontier_op"],
                          "waiting": waiting, "culprits": missing,
                          "tie": len(missing) == len(waiting),
                          "waits_in": {"group": g, "seq": gg["frontier"],
                                       "op": gg["frontier_op"]}})
    return found
