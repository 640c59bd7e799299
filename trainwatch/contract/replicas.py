"""The replica digests' record and vote, shared by their readers: the agent's judge
(``agent/replicas.py``), the replica rollback's confirmation and diagnose. A rank's status
lists its newest parameter digests (``trainer/replicas.py``); at one step, replicas must
hold equal digests (bits, or norms within the tolerance). The ranks outside a strict
majority are the suspects; without one, every rank compared is "one of" them."""

from __future__ import annotations

import statistics
from typing import Any

MAX_DIGESTS = 16      # a status lists 8; more is not ours
MAX_SUSPECTS_NAMED = 8  # a label names at most this many ranks, then "+N"
_HEX = frozenset("0123456789abcdef")


def digests(value: Any) -> list[dict[str, Any]]:
    """The well-formed digests of a rank's status ``replicas`` field (others dropped)."""
    if not isinstance(value, list):
        return []
    return [d for d in map(digest, value[-MAX_DIGESTS:]) if d is not None]


def digest(d: Any) -> dict[str, Any] | None:
    """One digest record, checked and normalised (group as text), or None."""
    if not isinstance(d, dict):
        return None
    step, bits, group = d.get("step"), d.get("bits"), d.get("group", 0)
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return None
    if not (isinstance(bits, str) and len(bits) == 16 and set(bits) <= _HEX):
        return None
    if isinstance(group, bool) or not isinstance(group, (int, str)) or len(str(group)) > 64:
        return None
    return {"step": step, "group": str(group), "bits": bits,
            "norm": _number(d.get("norm")), "tolerance": _number(d.get("tolerance"))}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def vote(by_rank: dict[int, dict[str, Any]]) -> tuple[list[int], bool]:
    """(suspect ranks, whether a strict majority agreed) for one step's digests.

    No suspects: all agree. Suspects with a majority: the ranks outside it. Without one:
    every rank compared."""
    ranks = sorted(by_rank)
    tolerances = [by_rank[r]["tolerance"] for r in ranks]
    norms = [by_rank[r]["norm"] for r in ranks]
    if any(t is not None for t in tolerances) and all(n is not None for n in norms):
        tol = max(t for t in tolerances if t is not None)
        middle = statistics.median(n for n in norms if n is not None)
        scale = max(abs(middle), 1e-30)
        agree = [r for r, n in zip(ranks, norms) if n is not None and abs(n - middle) <= tol * scale]
    else:
        counts: dict[str, list[int]] = {}
        for r in ranks:
            counts.setdefault(by_rank[r]["bits"], []).append(r)
        agree = max(counts.values(), key=len)
    if len(agree) == len(ranks):
        return [], True
    if 2 * len(agree) > len(ranks):
        return [r for r in ranks if r not in agree], True
    return ranks, False


def suspects_label(suspects: list[int], majority: bool) -> str:
    """The alert's ``suspects`` label: "3", "3,7", or "one of 0,1" without a majority."""
    named = ",".join(str(r) for r in suspects[:MAX_SUSPECTS_NAMED])
    if len(suspects) > MAX_SUSPECTS_NAMED:
        named += f",+{len(suspects) - MAX_SUSPECTS_NAMED}"
    return named if majority else f"one of {named}"
