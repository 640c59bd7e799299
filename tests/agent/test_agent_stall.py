"""Stall budgets and kinds (the SIGSTOP run is in the end-to-end test)."""

import os
import time

import psutil

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


def test_busy_is_not_frozen():
    """A stale heartbeat with the process runnable and burning CPU (C code holding the GIL
    starves the telemetry thread) is busy: the evidence says R and the CPU it used. Without
    CPU used, or not runnable, a stale heartbeat is still frozen."""
    det = StallDetector(dict(STALL_DEFAULTS))
    now, key = 1000.0, ("j", 1, 1)
    det.observe(key, rank(now, progress_age=0))

    def check(**process):
        r = rank(now, progress_age=12.0, heartbeat_age=12.0, status="running")
        r["process"].update(process)
        return det.check(key, r)
    busy = check(cpu_cores=1.0, main_runnable=1.0)
    assert busy.stalled and busy.kind == "busy", busy
    assert busy.reason.startswith("R, 100 % CPU, main thread runnable 100 %"), busy.reason
    # a loaded machine gives it a fraction of a core, but its main thread is always runnable
    loaded = check(cpu_cores=0.1, main_runnable=0.95)
    assert loaded.kind == "busy" and "R, 10 % CPU" in loaded.reason, loaded
    assert check(cpu_cores=0.3).kind == "busy"
    assert check(cpu_cores=0.01, main_runnable=0.02).kind == "frozen"
    assert check().kind == "frozen"  # no CPU rate known yet
    assert check(status="sleeping", cpu_cores=1.0, main_runnable=1.0).kind == "frozen"
    assert check(status="stopped", cpu_cores=1.0).kind == "frozen"
    # the heartbeat is fresh: a rank burning CPU without a step outside a collective spins
    # in Python (diagnose says busy, with its stack); inside a collective phase a CPU
    # spent polling for peers is waiting, still stuck
    fresh = rank(now, progress_age=12.0, status="running")
    fresh["process"].update(cpu_cores=1.0, main_runnable=1.0)
    spin = det.check(key, fresh)
    assert spin.kind == "busy", spin
    assert spin.reason.startswith("R, 100 % CPU, main thread runnable 100 %, heartbeat "
                                  "fresh, step not advancing"), spin.reason
    fresh["phase"] = "allreduce"
    assert det.check(key, fresh).kind == "stuck"
    fresh.update(phase="forward", process={"status": "running", "cpu_cores": 0.01,
                                           "main_runnable": 0.02})
    assert det.check(key, fresh).kind == "stuck"  # alive, waiting, no CPU


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
    alone = StallDetector(dict(STALL_DEFAULTS))  # never saw rank 0 evaluate
    alone.observe(key1, rank(0, progress_age=0))
    assert alone.check(key1, waiting).stalled  # its own budget (5 s) is long gone
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



def at(t, *, progress_at=0.0, **kw):
    """A rank seen at time ``t`` whose last step ended at ``progress_at``."""
    return rank(t, progress_age=t - progress_at, **kw)


def test_the_budget_a_phase_covered_is_not_charged_again_when_the_phase_ends():
    """Ranks publish once per heartbeat, at different moments: the agent sees rank 0 leave
    its evaluation before it sees the step rank 1 finished right after. The ordinary budget
    then counts from the end of the phase, for the rank that evaluated and for the one that
    waited; a hang after the phase is still caught one ordinary budget later."""
    from trainwatch.agent.stall import phase_holds
    det = StallDetector(dict(STALL_DEFAULTS))
    key0, key1 = ("j", 0, 1), ("j", 1, 2)
    for key in (key0, key1):
        det.observe(key, rank(0, progress_age=0))  # typical step 0.1 s: budget 5 s

    def look(r0, r1):
        ranks = [dict(r0, rank=0), dict(r1, rank=1)]
        holders = phase_holds(det, ranks)
        return [det.check(k, r, holders=holders) for k, r in zip((key0, key1), ranks)]

    def waiting(t):  # rank 1 in the next step's collective since just after step 10
        return at(t, phase="backward", step=11) | {"phase_age": t - 0.2}

    for t in (30.0, 60.0, 89.0):  # rank 0 evaluates from 0.5 s on
        evaluating = at(t, phase="eval") | {"phase_age": t - 0.5}
        assert not any(v.stalled for v in look(evaluating, waiting(t)))
    # rank 0 is back in a step (none completed yet), rank 1 still waits for it
    after = look(at(90.5, phase="forward", step=11), waiting(90.5))
    assert not any(v.stalled for v in after), after
    assert "in a phase with its own budget" in after[1].reason
    # rank 0 finished that step; rank 1's beat that shows the same is not written yet
    seen = look(at(91.0, progress_at=90.8, step=11), waiting(91.0))
    assert not any(v.stalled for v in seen), seen
    # ... but rank 1 hangs from there: caught once the ordinary budget (5 s) is spent
    hung = look(at(96.0, progress_at=95.9, step=40), waiting(96.0))
    assert not hung[0].stalled and hung[1].stalled and hung[1].kind == "stuck", hung
    assert "since a phase with its own budget ended" in hung[1].reason
    # a step starts a new stretch: the evaluation excuses nothing after it
    det.check(key1, at(97.0, progress_at=96.9, step=12) | {"rank": 1})
    later = det.check(key1, at(103.0, progress_at=96.9, step=12) | {"rank": 1})
    assert later.stalled and later.budget == STALL_DEFAULTS["floor_seconds"], later


def test_an_overrun_phase_is_excused_no_more_than_its_budget():
    det = StallDetector({**STALL_DEFAULTS, "phase_budgets": {"eval": 15.0}})
    key = ("j", 0, 1)
    det.observe(key, rank(0, progress_age=0))
    assert not det.check(key, at(14.0, phase="eval")).stalled
    assert det.check(key, at(17.0, phase="eval")).stalled  # hung in the evaluation
    out = det.check(key, at(21.0, phase="forward"))
    assert out.stalled and out.budget == 14.0 + STALL_DEFAULTS["floor_seconds"], out


def test_full_disk_rank1_seen_behind_rank0_after_its_evaluation_is_no_stall(tmp_path):
    """The agent's real collectors on a run whose disk is full (status files stale, beat
    files current): rank 0's beat already shows it back from a 90 s evaluation and past
    the next step; rank 1's newest beat was written just before it finished that step."""
    from trainwatch.agent.config import build_config
    from trainwatch.agent.context import AgentContext
    from trainwatch.agent.registry import all_collectors
    from trainwatch.agent.state import CollectorRecord
    from trainwatch.rundir.beat import BeatWriter, beat_path
    from trainwatch.rundir.run_dir import RunDir

    run = RunDir(tmp_path / "exp").create()
    ctx = AgentContext(build_config({"run_dirs": [str(run.root)]}))
    ranks, findings = (all_collectors()[name].factory(ctx, ctx.config.collector(name))
                       for name in ("ranks", "findings"))
    pid, started = os.getpid(), psutil.Process().create_time()
    now = time.time()
    beats = {}
    for r in (0, 1):  # the last status files written before the disk filled
        run.write_status(r, {"job": "exp", "rank": r, "local_rank": r, "world_size": 2,
                             "pid": pid, "started_at": started, "heartbeat_at": now - 80,
                             "step": 8, "phase": "forward", "phase_since": now - 80,
                             "last_progress_at": now - 80, "state": "running",
                             "metrics": {"step": 8, "step_time_seconds": 0.3}})
        beats[r] = BeatWriter(beat_path(run.status_dir, r))

    def beat(r, step, phase, progress_at, phase_since):
        beats[r].write({"v": 1, "rank": r, "pid": pid, "state": "running",
                        "heartbeat_at": time.time(), "step": step, "phase": phase,
                        "last_progress_at": progress_at, "phase_since": phase_since,
                        "publish_failing_since": now - 70})

    def judge() -> list:
        result = ranks.collect()
        ctx.store.set(CollectorRecord("ranks", True, 1, 1, state=result.state,
                                      data=result.data))
        return [f for f in findings.collect().data["findings"] if f["kind"] == "stall"]

    try:
        beat(0, 30, "eval", now - 89.0, now - 88.8)
        beat(1, 31, "backward", now - 89.0, now - 88.9)
        assert judge() == []  # rank 1 waits for rank 0's evaluation
        beat(0, 32, "forward", time.time() - 0.1, time.time() - 0.05)
        assert judge() == []
    finally:
        for writer in beats.values():
            writer.close()


def test_a_killed_rank_is_dead_at_once_not_stuck_while_its_last_heartbeat_is_fresh():
    """A rank process the agent saw alive is SIGKILLed a moment after its last heartbeat:
    gone with a fresh heartbeat is dead (TrainingRankDown), not "stuck" (a stall on rank
    unknown, for up to heartbeat_stale_seconds). A pid never seen alive keeps needing a
    stale heartbeat: an agent in another pid namespace sees every rank as gone."""
    import signal
    import subprocess

    from trainwatch.host.procinfo import ProcessTracker

    tracker = ProcessTracker()
    victim = subprocess.Popen(["sleep", "60"])
    try:
        det = StallDetector(dict(STALL_DEFAULTS))
        time.sleep(0.05)
        now, key = time.time(), ("j", 1, 1)  # the rank's telemetry starts after its process
        view = rank(now, progress_age=0)
        view["pid"], view["started_at"] = victim.pid, now
        view["process"] = tracker.inspect(victim.pid, view["started_at"])
        assert not det.check(key, view).stalled and view["process"]["status"] != "gone"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        view = rank(now, progress_age=6.0, heartbeat_age=0.5)
        view["pid"], view["started_at"] = victim.pid, now
        view["process"] = tracker.inspect(victim.pid, view["started_at"])
        assert view["process"]["status"] == "gone"
        verdict = det.check(key, view)
        assert verdict.stalled and verdict.kind == "dead", verdict
        unseen = StallDetector(dict(STALL_DEFAULTS)).check(("j", 2, 1), view)
        assert unseen.kind == "stuck", unseen  # never seen alive: not called dead yet
    finally:
        victim.kill()
        victim.wait()
