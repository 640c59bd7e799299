"""Which ranks the others wait for, and where the collective sequences disagree.

Per process group: the frontier is the highest collective sequence number any
rank has enqueued. Ranks in flight at the frontier are waiting; ranks below it
are missing from the collective the others wait in (``who_waits``, shared with the agent
in trainwatch/contract/collectives.py, as is ``crossed_waits``). A mismatch is the first
sequence number at which ranks issued different ops, sizes or dtypes (a desync).
"""

from __future__ import annotations

import statistics
from typing import Any

from trainwatch.contract.collectives import who_waits

LATENESS_WINDOW = 50


def analyse(groups: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {pg: analyse_group(group) for pg, group in groups.items() if group["per_rank"]}


def analyse_group(group: dict[str, Any]) -> dict[str, Any]:
    per_rank: dict[int, dict[str, Any]] = group["per_rank"]
    waits = who_waits({r: (v["last_enqueued"], v.get("last_completed"))
                       for r, v in per_rank.items()})
    frontier, waiting = waits["frontier"], waits["waiting"]
    frontier_op = next((describe(per_rank[r]["entries"].get(frontier)) for r in waiting
                        if per_rank[r]["entries"].get(frontier)), None)
    return {"desc": group.get("desc"), "ranks": sorted(per_rank), "frontier": frontier,
            "frontier_op": frontier_op, "waiting": waiting, "behind": waits["behind"],
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
