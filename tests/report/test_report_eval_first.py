"""An evaluation before a launch's first step (a loop that evaluates at step 0 before
training it, a resumed run that evaluates first) is evaluation, not start-up or restart
downtime: its record says how long it took (``seconds``, written by the telemetry's
``with tel.phase("eval")``), which places it without a step before it. Measured on a real
loop (2 s evaluation at step 0): 2.02 s were booked as start-up before."""

from report_helpers import T0, Run, assert_sums_to_wall, near, report_json
from trainwatch.rundir.atomic import append_jsonl


def _evaluated_first(r: Run, step: int, seconds: float) -> None:
    """The telemetry's record of an eval phase before the first step (rank/recorder.py)."""
    r.wait(seconds)
    append_jsonl(r.run.metrics_file(0), {"v": 1, "kind": "eval", "step": step,
                                         "time": T0 + r.clock, "rank": 0, "seconds": seconds,
                                         "before_step": True})


def test_an_evaluation_before_a_launchs_first_step_is_evaluation(tmp_path):
    r = Run(tmp_path / "run", steps=20)
    r.event("launcher_started", "launcher", pid=1)
    r.wait(1)
    pids = r.attempt(0)
    r.rank_event("run_started", world_size=2, start_step=0, steps=20)
    r.wait(0.5)
    _evaluated_first(r, 0, 3.0)                     # evaluates at step 0, before training it
    r.steps(0, 9, data_wait=0.0)
    r.rank_event("failed", 1, error="RuntimeError: boom")
    r.torchrun_failed(pids[1], 1, 1)
    r.wait(2)
    r.attempt(1)
    r.rank_event("checkpoint_resumed", step=10)
    r.wait(0.5)
    _evaluated_first(r, 10, 4.0)                    # the resumed run evaluates first
    r.wait(0.25)
    r.steps(10, 19, data_wait=0.0)
    r.rank_event("finished", step=19, steps=20)
    r.event("launcher_exited", "launcher", exit_code=0)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    c = data["categories"]
    assert c["evaluation"] == near(3.0 + 4.0)
    assert c["initial_startup"] == near(1.5)
    (incident,) = data["incidents"]
    assert incident["restart_downtime_seconds"] == near(2.0 + 0.5 + 0.25)
    assert c["restart_downtime"] == near(2.75) and c["other"] == near(0.0)
