"""One stall incident per job and node: the culprit rank(s) and the ranks that wait for them.

When one rank stops, every other rank blocks in its next collective and stalls too; a
page per rank would bury the one that matters.  The evidence on this node decides who the
culprit is: a dead or frozen rank first (nothing in it runs), then a busy one (it burns a CPU
outside a collective: C code holding the GIL, or a Python loop). Among stuck ranks, what
they publish about their collectives decides when every one of them does
(``trainwatch/agent/collective_culprit.py``: who did not enter the collective the others wait
in, whatever their phases); else their phases: a stuck rank outside a collective phase
while others wait inside one, else the ranks behind on step.  A node whose
stalled ranks all wait (the culprit is elsewhere, or cannot be told apart) names none:
the alert rule then takes the culprit another node's agent named, or says "unknown".
When every stalled rank waits in a collective but at different steps, the collective
sequences went apart (a rank skipped one, or issued an extra one): the smaller side is
the culprit, whether it is ahead or behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainwatch.agent.collective_culprit import decide, progress_of
from trainwatch.contract.states import COLLECTIVE_PHASES

_KIND_ORDER = {"dead": 0, "frozen": 1, "busy": 2, "stuck": 3}
_STUCK = _KIND_ORDER["stuck"]


@dataclass
class Incident:
    culprits: list[int]
    waiting: list[int]
    kind: str                       # the culprits' stall kind, or "unknown"
    since: float | None             # when the first of them stopped progressing
    reason: str
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    node: str | None = None         # the culprits' node when another (culprit_elsewhere)

    @property
    def culprit(self) -> int | None:
        """The one rank the alert names (the first culprit), None when unknown."""
        return self.culprits[0] if self.culprits else None


def group(stalled: list[tuple[dict[str, Any], Any]]) -> Incident | None:
    """``stalled``: (rank view, StallVerdict) of the node's stalled ranks of one job."""
    if not stalled:
        return None
    by_rank = {rank["rank"]: (rank, verdict) for rank, verdict in stalled}
    kinds = {r: v.kind for r, (_, v) in by_rank.items()}
    worst = min(_KIND_ORDER.get(k, _STUCK) for k in kinds.values())
    culprits: list[int] = []
    reason = ""
    if worst < _STUCK:  # dead, frozen or busy (outside a collective phase): none waits in one
        culprits = [r for r, k in kinds.items() if _KIND_ORDER.get(k, _STUCK) == worst]
        reason = f"{kinds[culprits[0]]} while the others wait"
    elif (progress := progress_of({r: rank for r, (rank, _) in by_rank.items()})) is not None \
            and (decided := decide(progress, _world_size(by_rank))) is not None:
        culprits, reason = decided
    else:
        culprits, reason = _by_phase(by_rank)
    culprits.sort(key=lambda r: (by_rank[r][1].since or 0.0, r))
    waiting = sorted(r for r in by_rank if r not in culprits)
    sinces = [v.since for _, v in by_rank.values() if v.since is not None]
    kind = kinds[culprits[0]] if culprits else "unknown"
    if not culprits:
        reason = reason or ("all stalled ranks here wait alike: the culprit is on another "
                            "node or unclear")
    elif len(culprits) > 1 and not waiting:
        # Every rank of the node at once: one node-level incident (hung storage, a driver,
        # the host), named by its first rank, not one page per rank.
        reason = f"every stalled rank on this node is {kind}: a node-level problem"
    return Incident(culprits, waiting, kind, min(sinces) if sinces else None, reason,
                    {r: rank for r, (rank, _) in by_rank.items()})


def _by_phase(by_rank: dict[int, tuple[dict[str, Any], Any]]) -> tuple[list[int], str]:
    """Stuck ranks judged by their phases: one outside a collective phase while others wait
    inside one; else, at different steps, the odd ones out or the ones behind."""
    phases = {r: str(rank.get("phase") or "") for r, (rank, _) in by_rank.items()}
    waiting_in_collective = [r for r, p in phases.items() if p in COLLECTIVE_PHASES]
    outside = [r for r, p in phases.items() if p not in COLLECTIVE_PHASES]
    if waiting_in_collective and outside:
        return outside, ("stuck outside a collective (phase "
                         f"{', '.join(sorted({phases[r] for r in outside}))}) while the "
                         "others wait in one")
    steps: dict[int, int] = {r: step for r, (rank, _) in by_rank.items()
                             if isinstance(step := rank.get("step"), int)}
    if len(set(steps.values())) > 1 and not outside:
        return _out_of_step(steps)
    if len(set(steps.values())) > 1:
        low = min(steps.values())
        return [r for r, s in steps.items() if s == low], f"behind the others (step {low})"
    return [], ""


def _world_size(by_rank: dict[int, tuple[dict[str, Any], Any]]) -> int | None:
    sizes = {rank.get("world_size") for rank, _ in by_rank.values()}
    size = sizes.pop() if len(sizes) == 1 else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _out_of_step(steps: dict[int, int]) -> tuple[list[int], str]:
    """Every rank waits in a collective, at different steps: a rank a step ahead skipped a
    collective the others wait in, or ranks a step behind issued an extra one. Either way
    the odd one out is the smaller side; equal sides name no one."""
    sides: dict[int, list[int]] = {}
    for rank, step in steps.items():
        sides.setdefault(step, []).append(rank)
    ordered = sorted(sides.values(), key=len)
    if len(ordered[0]) == len(ordered[1]):
        return [], ""
    odd = sorted(ordered[0])
    return odd, (f"out of step with the others (step {steps[odd[0]]}, while all wait in "
                 "collectives): a skipped or extra collective")
