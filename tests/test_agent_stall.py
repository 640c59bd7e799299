"""Stall budgets and kinds (the SIGSTOP run is in the end-to-end test)."""

from trainwatch.agent.stall import StallDetector
from trainwatch.contract.stall import STALL_DEFAULTS


def rank(now, *, progress_age, heartbeat_age=0.2, phase="forward", status="sleeping",
         state="running", step=10, step_time=0.1):
    return {"state": state, "phase": phase, "step": step, "pid": 1,
            "last_progress_at": now - progress_age, "heartbeat_at": now - heartbeat_age,
            "started_at": now - 100, "process": {"status": status},
            "metrics": {"step": step, "step_time_seconds": step_time}}


def test_budget_is_floor_or_k_times_typical_step():
    det = StallDetector(dict(STALL_DEFAULTS))
    now = 1000.0
    key = ("job", 0, 1)
    first = det.check(key, rank(now, progress_age=1.0), now)
    assert not first.stalled and first.budget == STALL_DEFAULTS["floor_seconds"]
    slow = StallDetector(dict(STALL_DEFAULTS))
    for step in range(5):
        slow.observe(key, rank(now, progress_age=0, step=step, step_time=2.0))
    verdict = slow.check(key, rank(now, progress_age=15.0), now)
    assert verdict.budget == 20.0 and not verdict.stalled  # k=10 x 2 s


def test_no_typical_step_yet_uses_first_step_budget():
    det = StallDetector(dict(STALL_DEFAULTS))
    r = rank(1000.0, progress_age=60.0)
    r["metrics"] = {}
    verdict = det.check(("j", 0, 1), r, 1000.0)
    assert not verdict.stalled and verdict.budget == STALL_DEFAULTS["first_step_seconds"]


def test_kinds_stuck_frozen_dead_and_clearing():
    det = StallDetector(dict(STALL_DEFAULTS))
    now, key = 1000.0, ("j", 1, 1)
    det.observe(key, rank(now, progress_age=0))
    stuck = det.check(key, rank(now, progress_age=7.0), now)
    assert stuck.stalled and stuck.kind == "stuck" and stuck.since == now - 7.0
    frozen = det.check(key, rank(now, progress_age=7.0, heartbeat_age=7.0, status="stopped"), now)
    assert frozen.stalled and frozen.kind == "frozen"
    # SIGSTOP seen by the OS before the heartbeat is old enough to call stale: still frozen
    stopped = det.check(key, rank(now, progress_age=5.5, heartbeat_age=5.4, status="stopped"), now)
    assert stopped.stalled and stopped.kind == "frozen"
    silent = det.check(key, rank(now, progress_age=7.0, heartbeat_age=6.0), now)
    assert silent.stalled and silent.kind == "frozen"  # heartbeat stale, state unknown
    brief_io = det.check(key, rank(now, progress_age=7.0, status="disk_sleep"), now)
    assert brief_io.kind == "stuck"  # D state with a live heartbeat: not frozen
    dead = det.check(key, rank(now, progress_age=1.0, heartbeat_age=6.0, status="gone"), now)
    assert dead.stalled and dead.kind == "dead"
    resumed = det.check(key, rank(now, progress_age=0.1), now)
    assert not resumed.stalled
    done = det.check(key, rank(now, progress_age=99, state="finished"), now)
    assert not done.stalled


def test_phase_budgets_apply_unless_the_process_is_stopped():
    det = StallDetector(dict(STALL_DEFAULTS))
    now, key = 1000.0, ("j", 0, 1)
    det.observe(key, rank(now, progress_age=0))
    saving = det.check(key, rank(now, progress_age=60.0, phase="checkpoint"), now)
    assert not saving.stalled and saving.budget == STALL_DEFAULTS["phase_budgets"]["checkpoint"]
    stopped = det.check(key, rank(now, progress_age=60.0, heartbeat_age=60.0,
                                  phase="checkpoint", status="stopped"), now)
    assert stopped.stalled and stopped.kind == "frozen"
    assert stopped.budget == STALL_DEFAULTS["floor_seconds"]


def test_init_budget_only_before_the_first_step():
    """Before the first step a rank gets the long init budget; between phase blocks later
    ("step" or "idle") it gets the budget derived from its own step times."""
    det = StallDetector(dict(STALL_DEFAULTS))
    now, key = 1000.0, ("j", 0, 1)
    fresh = rank(now, progress_age=60.0, phase="init")
    fresh["metrics"] = {}
    assert not det.check(key, fresh, now).stalled  # still initialising: 600 s budget
    det.observe(key, rank(now, progress_age=0))
    verdict = det.check(key, rank(now, progress_age=7.0, phase="idle"), now)
    assert verdict.stalled and verdict.kind == "stuck"
