"""A stall's culprit from what the ranks publish about their collectives, not their phases.

A phase says what a rank's loop meant to do; a user's own phase (``metrics``) may hold a
collective on a side group, and a rank in it would look like one "outside a collective".
The beat files carry, per process group, the newest collective each rank enqueued and
completed (``collectives``, trainwatch/contract/collectives.py): the same counters, and the
same decision, as ``diagnose`` takes from the flight-recorder dumps:

* ranks inside no collective, behind a group's collective that others wait in: they did
  not enter it, the others wait for them;
* ranks waiting in group h's collective #n that the others never entered, while those
  others wait in group g's collective that the first never entered (crossed): one side
  skipped a collective or issued an extra one; the smaller side is the culprit, equal sides
  name none. Only with every rank of the job in view: a node seeing part of the job
  cannot tell which side is smaller, and names none;
* else no stalled rank here is missing from a collective the others wait in: the culprit
  is on another node, or unclear.
"""

from __future__ import annotations

from typing import Any, Mapping

from trainwatch.contract.collectives import by_group, crossed_waits, in_collective, never_entered

Progress = Mapping[int, Mapping[str, tuple[int, int]]]


def decide(progress: Progress, world_size: int | None) -> tuple[list[int], str] | None:
    """(culprits, reason) from the stalled ranks' progress {rank: {group: (enqueued,
    completed)}]; culprits empty when it cannot be told here; None when no rank is inside a
    collective (the progress says nothing of who waits: the phase rules decide)."""
    busy = {r for r, groups in progress.items()
            if any(in_collective(enq, done) for enq, done in groups.values())}
    if not busy:
        return None
    analysed = by_group(progress)
    missing = never_entered(analysed, busy)
    if missing:
        first = missing[0]
        culprits = sorted({r for m in missing for r in m["culprits"]})
        return culprits, (f"in no collective; did not enter collective #{first['seq']} of "
                          f"process group {first['group']}, which rank(s) "
                          f"{first['waiting']} wait in")
    crossed = sorted(crossed_waits(analysed), key=lambda c: c["tie"])
    if not crossed:
        return [], ("no stalled rank here is missing from a collective the others wait in: "
                    "the culprit is on another node or unclear")
    c, other = crossed[0], crossed[0]["waits_in"]
    seen = (f"rank(s) {c['waiting']} wait in collective #{c['seq']} of process group "
            f"{c['group']}, rank(s) {c['culprits']} in #{other['seq']} of process group "
            f"{other['group']}, each never entered by the other side")
    if c["tie"]:
        return [], f"{seen}: a skipped or extra collective; equal sides, no odd one out"
    if not isinstance(world_size, int) or len(progress) < world_size:
        return [], (f"{seen}: a skipped or extra collective; this node sees "
                    f"{len(progress)} of {world_size or '?'} ranks, so which side is the "
                    "odd one out cannot be told here")
    return c["culprits"], (f"did not enter collective #{c['seq']} of process group "
                           f"{c['group']}, which rank(s) {c['waiting']} wait in; waits in "
                           f"collective #{other['seq']} of process group {other['group']} "
                           "instead, which they never entered: a skipped or extra collective "
                           f"({len(c['culprits'])} against {len(c['waiting'])})")


def progress_of(ranks: Mapping[int, Mapping[str, Any]]) -> dict[int, Any] | None:
    """Each rank's ``collectives`` (the agent's rank view), or None unless every rank has
    one: a rank without it (its flight recorder off, no collective yet) leaves the phases
    to decide."""
    progress = {r: view.get("collectives") for r, view in ranks.items()}
    if not progress or not all(isinstance(p, Mapping) and p for p in progress.values()):
        return None
    return progress
