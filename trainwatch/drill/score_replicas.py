"""The ``sdc`` drill's own criteria: what a rollback after silent data corruption must get
right beyond restarting (docs/sdc.md). The alert must name the corrupted rank, fire within a
few digests of the flip, and the job must resume from weights saved before the flip and end
with every replica holding the same weights again."""

from __future__ import annotations

from typing import Any, Sequence

from trainwatch.drill.catalog import Drill
from trainwatch.rundir.run_dir import RunDir

CRITERIA = ("suspect named", "detected within steps", "clean checkpoint",
            "replicas agree at the end")


def applies(drill: Drill) -> bool:
    return drill.action == "replica_rollback"


def _verdict(name: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": passed, "detail": detail}


def criteria(drill: Drill, run: RunDir, events: Sequence[dict[str, Any]], execs,
             fault_step: int | None, t0: float,
             resumed_from: int | None) -> list[dict[str, Any]]:
    if not isinstance(fault_step, int):
        return [_verdict(name, False, "the fault_injected event has no step")
                for name in CRITERIA]
    alert = next((s.name for s in drill.detect), None)
    firing = [e for e in events if e["event"] == "alert_firing" and e.get("alert") == alert
              and e["time"] >= t0]
    taken = [e for e in events if e["event"] == "action_taken"
             and e.get("action") == drill.action and e["time"] >= t0]
    return [_suspect(drill, firing, taken), _steps(drill, firing, execs, fault_step),
            _clean(fault_step, taken, resumed_from), _agree(run)]


def _suspect(drill: Drill, firing, taken) -> dict[str, Any]:
    name = "suspect named"
    if not firing:
        return _verdict(name, False, "the alert never fired: no suspect was named")
    said = (firing[0].get("labels") or {}).get("suspects")
    acted = [s.get("rank") for s in taken[0].get("suspects") or []] if taken else None
    text = f"the alert named suspects={said!r}; the action's suspects: {acted}"
    ok = said == str(drill.fault_rank) and acted == [drill.fault_rank]
    return _verdict(name, ok, text + ("" if ok else f", expected rank {drill.fault_rank} alone"))


def _steps(drill: Drill, firing, execs, fault_step: int) -> dict[str, Any]:
    """Steps from the fault to the alert: rank 0's newest completed step when it fired."""
    name, within = "detected within steps", drill.detect_within_steps
    if not firing:
        return _verdict(name, False, "the alert never fired")
    at = firing[0]["time"]
    done = [e.step for e in execs if e.end <= at]
    if not done:
        return _verdict(name, False, "no step completed before the alert fired")
    steps = max(done) - fault_step
    text = f"the alert fired at step {max(done)}, {steps} steps after the fault"
    ok = within is None or steps <= within
    return _verdict(name, ok, text + (f" (within {within})" if ok and within is not None
                                      else f", more than the {within} allowed" if not ok
                                      else ""))


def _clean(fault_step: int, taken, resumed_from: int | None) -> dict[str, Any]:
    """A checkpoint numbered ``s`` holds steps 0..s-1; the flip follows step ``fault_step``'s
    update, so a checkpoint at most ``fault_step`` never held it."""
    name = "clean checkpoint"
    if not taken:
        return _verdict(name, False, "no replica_rollback was taken")
    chosen = taken[0].get("clean_checkpoint_step")
    if resumed_from is None:
        return _verdict(name, False, f"the rollback chose checkpoint {chosen}, but the "
                        "restarted job's resume step is not in the run directory")
    text = (f"resumed from checkpoint {resumed_from} (the rollback chose {chosen}; the fault "
            f"followed step {fault_step})")
    if resumed_from > fault_step:
        return _verdict(name, False, text + ": saved after the fault, so it holds the "
                        "corrupted weight")
    if chosen is not None and resumed_from != chosen:
        return _verdict(name, False, text + ": not the checkpoint the rollback chose")
    return _verdict(name, True, text + ": saved before the fault")


def _agree(run: RunDir) -> dict[str, Any]:
    """The newest digest of every rank: the same step and the same bits."""
    name = "replicas agree at the end"
    last = {}
    for status in run.statuses().records:
        digests = status.get("replicas") or []
        if isinstance(status.get("rank"), int) and digests and isinstance(digests[-1], dict):
            last[status["rank"]] = (digests[-1].get("step"), digests[-1].get("bits"))
    if len(last) < 2:
        return _verdict(name, False, f"digests of {len(last)} rank(s) in the status files")
    if len(set(last.values())) != 1:
        odd = ", ".join(f"rank {r}: step {s} bits {b}" for r, (s, b) in sorted(last.items()))
        return _verdict(name, False, f"the ranks' last digests differ ({odd})")
    step, _ = next(iter(last.values()))
    return _verdict(name, True, f"the last digest (step {step}) is bitwise equal on all "
                    f"{len(last)} ranks")
