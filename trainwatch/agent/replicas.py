"""Replica divergence: compare the parameter digests data-parallel ranks publish
(``trainer/replicas.py``) and name the rank whose weights differ from the majority's.

For each run and replica group, a step is compared once every running rank of the group
that this agent sees has published its digest (a step some rank skipped is passed over
once a newer one is complete). Exact digests vote by their bits; digests with a
tolerance by their norm, relative to the median. The ranks outside a strict majority are
the suspects; without a majority (two replicas, or a tie) every rank compared is "one
of" the suspects and none is named alone. A verdict counts consecutive compared digests:
a corrupted weight stays corrupted, so the next digest confirms it, and one odd digest
alone (never a single observation) acts on nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
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


@dataclass
class GroupVerdict:
    """One run's replica group as compared so far."""

    last_step: int = -1
    compared: int = 0            # ranks in the last compared step
    agreeing: int = 0            # the largest agreeing set in it
    suspects: list[int] = field(default_factory=list)
    majority: bool = True
    streak: int = 0              # consecutive compared digests with these same suspects
    mismatch: dict[int, int] = field(default_factory=dict)  # rank -> consecutive odd digests

    def judge(self, step: int, by_rank: dict[int, dict[str, Any]]) -> None:
        suspects, majority = vote(by_rank)
        self.last_step, self.compared = step, len(by_rank)
        self.agreeing = len(by_rank) - len(suspects) if majority else 0
        if suspects and suspects == self.suspects and majority == self.majority:
            self.streak += 1
        else:
            self.streak = 1 if suspects else 0
        self.suspects, self.majority = suspects, majority
        for rank in by_rank:
            odd = majority and rank in suspects
            self.mismatch[rank] = self.mismatch.get(rank, 0) + 1 if odd else 0


class ReplicaJudge:
    """Every run's replica groups, fed the ranks collector's rank records each run."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], GroupVerdict] = {}

    def update(self, job: str, ranks: list[dict[str, Any]]) -> dict[str, GroupVerdict]:
        """Compare the steps newly complete in ``job``; its groups' verdicts by group."""
        steps: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
        live: dict[str, set[int]] = {}
        for r in ranks:
            for d in r.get("replicas") or ():
                steps.setdefault(d["group"], {}).setdefault(d["step"], {})[r["rank"]] = d
                if r.get("state") == "running":
                    live.setdefault(d["group"], set()).add(r["rank"])
        out = {}
        for group, by_step in steps.items():
            verdict = self.groups.setdefault((job, group), GroupVerdict())
            if max(by_step) < verdict.last_step:  # restarted from an earlier checkpoint
                verdict = self.groups[(job, group)] = GroupVerdict()
            expected = live.get(group) or {r for s in by_step.values() for r in s}
            complete = [s for s in sorted(by_step) if s > verdict.last_step
                        and expected <= set(by_step[s]) and len(by_step[s]) >= 2]
            for step in complete:
                verdict.judge(step, by_step[step])
            out[group] = verdict
        for key in [k for k in self.groups if k[0] == job and k[1] not in steps]:
            del self.groups[key]
        return out

    def forget(self, jobs: set[str]) -> None:
        for key in [k for k in self.groups if k[0] not in jobs]:
            del self.groups[key]
