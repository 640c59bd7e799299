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

from dataclasses import dataclass, field
from typing import Any

from trainwatch.contract.replicas import vote


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
