"""Where a replica rollback goes: the newest step whose parameter digests agreed on every
replica, from the digest history the ranks log (``kind: replicas`` lines of their
metrics logs, docs/sdc.md), and the ranks that diverged after it.

A checkpoint saved after step ``s`` holds the weights that step's digest covers and is
numbered ``s + 1`` (the steps it holds), so the clean checkpoints are those numbered at
most one past the newest agreeing digest before the first divergent one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainwatch.contract.replicas import digest, vote
from trainwatch.rundir.run_dir import RunDir


@dataclass
class Divergence:
    """What the digest history says: None fields where it has no answer."""

    first_odd_step: int | None = None    # the first compared digest that disagreed
    last_agreeing_step: int | None = None  # the newest agreeing one before it
    suspects: list[int] = field(default_factory=list)
    majority: bool = True
    digests: int = 0  # consecutive compared digests from the first odd one with these suspects

    @property
    def clean_checkpoint_step(self) -> int | None:
        """The largest checkpoint step (steps held) whose weights agreed; None: the first
        digest already disagreed, so no checkpoint is known clean but the start."""
        return None if self.last_agreeing_step is None else self.last_agreeing_step + 1

    def journal(self) -> dict[str, Any]:
        return {"first_odd_step": self.first_odd_step,
                "last_agreeing_step": self.last_agreeing_step,
                "suspects": self.suspects, "majority": self.majority,
                "digests": self.digests}


def find_divergence(run: RunDir, since: float = float("-inf")) -> Divergence:
    """The earliest divergence over every replica group in digests logged after ``since``
    (the last replica rollback: steps it replays are judged afresh)."""
    steps: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for rank in run.ranks_with_metrics():
        for record in run.metrics(rank).records:
            if record.get("kind") != "replicas" or not (
                    isinstance(record.get("time"), (int, float)) and record["time"] > since):
                continue
            d = digest(record)
            if d is not None:  # a later line of the same step (a restart) wins
                steps.setdefault((d["group"], d["step"]), {})[rank] = d
    found = Divergence()
    agreeing: dict[str, int] = {}
    odd_group = None
    for (group, step), by_rank in sorted(steps.items(), key=lambda kv: kv[0][1]):
        if len(by_rank) < 2 or (odd_group is not None and group != odd_group):
            continue
        suspects, majority = vote(by_rank)
        if odd_group is not None:  # confirming the first divergence
            if (suspects, majority) != (found.suspects, found.majority):
                break
            found.digests += 1
        elif suspects:
            odd_group = group
            found = Divergence(step, agreeing.get(group), suspects, majority, 1)
        else:
            agreeing[group] = step
    return found
