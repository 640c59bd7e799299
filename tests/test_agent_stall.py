"""Stall budgets and kinds (the SIGSTOP run is in the end-to-end test)."""

import time

from trainwatch.agent.stall import StallDetector
from trainwatch.contract.stall import STALL_DEFAULTS


def rank(now, *, progress_age, heartbeat_age=0.2, phase="forward", status="sleeping",
         state="running", step=10, step_time=0.1):
    return {"state": state, "phase": phase, "step": step, "pid": 1,
            "last_progress_at": now - progress_age, "heartbeat_at": now - heartbeat_age,
            "progress_age": progress_age, "heartbeat_age": heartbeat_age,
            "started_at": now - 100, "process": {"status": status},
            "metrics": {"step": step, "step_time_seconds": step_time}}


def test_budget_is_floor_or_k_times_typical_step():
    det = StallDetector(dict(STALL_DEFAULTS))
    now = 1000.0
    key = ("job", 0, 1)
    first = det.check(key, rank(now, progress_age=1.0))
    assert not first.stalled and first.budget == STALL_DEFAULTS["floor_seconds"]
    slow = StallDetector(dict(STALL_DEFAULTS))
    for step in range(5):
        slow.observe(key, rank(now, progress_age=0, step=step, step_time=2.0))
    verdict = slow.check(key, rank(now, progress_age=15.0))
    assert verdict.budget == 20.0 and not verdict.stalled  # k=10 x 2 s


def test_no_typical_step_yet_uses_first_step_budget():
    det = StallDetector(dict(STALL_DEFAULTS))
    r = rank(1000.0, progress_age=60.0)
    r["metrics"] = {}
    verdict = det.check(("j", 0, 1), r)
    assert not verdict.stalled and verdict.budget == STALL_DEFAULTS["first_step_seconds"]


def test_kinds_stuck_frozen_dead_and_clearing():
    det = StallDetector(dict(STALL_DEFAULTS))
    now, key = 1000.0, ("j", 1, 1)
    det.observe(key, rank(now, progress_age=0))
    stuck = det.check(key, rank(now, progress_age=7.0))
    assert stuck.stalled and stuck.kind == "stuck"
    assert abs(stuck.since - (time.time() - 7.0)) < 1
    frozen = det.check(key, rank(now, progress_age=7.0, heartbeat_age=7.0, status="stopped"))
    assert frozen.stalled and frozen.kind == "frozen"
    # SIGSTOP seen by the OS before the heartbeat is old enough to call stale: still frozen
    stopped = det.check(key, rank(now, progress_age=5.5, heartbeat_age=5.4, status="stopped"))
    assert stopped.stalled and stopped.kind == "frozen"
    silent = det.check(key, rank(now, progress_age=7.0, heartbeat_age=6.0))
    assert silent.stalled and silent.kind == "frozen"  # heartbeat stale, state unknown
    brief_io = det.check(key, rank(now, progress_age=7.0, status="disk_sleep"))
    assert brief_io.kind == "stuck"  # D state with a live heartbeat: not frozen
    dead = det.check(key, rank(now, progress_age=1.0, heartbeat_age=6.0, status="gone"))
    assert dead.stalled and dead.kind == "dead"
    resumed = det.check(key, rank(now, progress_age=0.1))
    assert not resumed.stalled
    done = det.check(key, rank(now, progress_age=99, state="finished"))
    assert not done.stalled


def test_phase_budgets_apply_unless_the_process_is_stopped():
    det = StallDetector(dict(STALL_DEFAULTS))
    now, key = 1000.0, ("j", 0, 1)
    det.observe(key, rank(now, progress_age=0))
    saving = det.check(key, rank(now, progress_age=60.0, phase="checkpoint"))
    assert not saving.stalled and saving.budget == STALL_DEFAULTS["phase_budgets"]["checkpoint"]
    stopped = det.check(key, rank(now, progress_age=60.0, heartbeat_age=60.0,
                                  phase="checkpoint", status="stopped"))
    assert stopped.stalled and stopped.kind == "frozen"
    assert stopped.budget == STALL_DEFAULTS["floor_seconds"]


def test_init_budget_only_before_the_first_step():
    """Before the first step a rank gets the long init budget; between phase blocks later
    ("step" or "idle") it gets the budget derived from its own step times."""
    det = StallDetector(dict(STALL_DEFAULTS))
    now, key = 1000.0, ("j", 0, 1)
    fresh = rank(now, progress_age=60.0, phase="init")
    fresh["metrics"] = {}
    assert not det.check(key, fresh).stalled  # still initialising: 600 s budget
    det.observe(key, rank(now, progress_age=0))
    verdict = det.check(key, rank(now, progress_age=7.0, phase="idle"))
    assert verdict.stalled and verdict.kind == "stuck"


def test_a_waiting_rank_inherits_the_budget_of_the_phase_the_slowest_rank_is_in():
    """Rank 0 evaluates alone (eval budget 300 s); rank 1 waits in the next collective."""
    from trainwatch.agent.stall import phase_holds
    det = StallDetector(dict(STALL_DEFAULTS))
    key0, key1 = ("j", 0, 1), ("j", 1, 2)
    det.observe(key1, rank(0, progress_age=0))
    evaluating = dict(rank(0, progress_age=90.0, phase="eval"), rank=0, phase_age=89.0)
    waiting = dict(rank(0, progress_age=90.0, phase="backward"), rank=1, phase_age=89.5)
    holders = phase_holds(det, [evaluating, waiting])
    assert [(h.rank, h.phase, h.budget) for h in holders] == [(0, "eval", 300.0)]
    verdict = det.check(key1, waiting, holders=holders)
    assert not verdict.stalled and "waiting for rank 0 in eval" in verdict.reason
    assert not det.check(key0, evaluating, holders=holders).stalled
    assert det.check(key1, waiting).stalled  # alone, its own budget (5 s) is long gone
    # a hang inside the evaluation: both are caught once the phase budget is spent
    hung = dict(evaluating, progress_age=302.0, phase_age=301.0)
    late = dict(waiting, progress_age=302.0)
    holders = phase_holds(det, [hung, late])
    assert det.check(key0, hung, holders=holders).stalled
    assert det.check(key1, late, holders=holders).stalled
    # a phase the job declared with its own budget (Telemetry.declare_phase)
    declared = dict(evaluating, phase="generate", phase_budgets={"generate": 120.0})
    holders = phase_holds(det, [declared, waiting])
    assert not det.check(key1, waiting, holders=holders).stalled
    holders = phase_holds(det, [dict(declared, progress_age=125.0, phase_age=124.0)])
    assert det.check(key1, dict(waiting, progress_age=125.0), holders=holders).stalled


def test_frozen_rank_inherits_nothing():
    from trainwatch.agent.stall import PhaseHold
    det = StallDetector(dict(STALL_DEFAULTS))
    key = ("j", 1, 2)
    det.observe(key, rank(0, progress_age=0))
    frozen = dict(rank(0, progress_age=60.0, heartbeat_age=60.0, status="stopped"), rank=1)
    verdict = det.check(key, frozen, holders=[PhaseHold(0, "eval", 300.0, 59.0)])
    assert verdict.stalled and verdict.kind == "frozen"
