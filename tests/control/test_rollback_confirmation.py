"""A loss alert's rollback acts only on a bad step a rank logged itself, within one launch.

TrainingLossSpike compares the loss gauge with its mean over a window that spans restarts:
a job that started again from earlier state (or from scratch) logs losses several times
the ones before the restart, and Prometheus calls that a spike. Rolling back on it would
throw checkpoints away for nothing.
"""

from __future__ import annotations

import json
import sys
import time

from trainwatch.control.actions import ActionRequest, ActionRunner, Policy
from trainwatch.control.bad_step import first_bad_step
from trainwatch.control.controller import JobController
from trainwatch.rundir.run_dir import RunDir


def _log(run, rank, steps_losses, t0):
    with open(run.metrics_file(rank), "a") as fh:
        for i, (step, loss) in enumerate(steps_losses):
            fh.write(json.dumps({"v": 1, "kind": "step", "step": step, "time": t0 + i * 0.01,
                                 "loss": loss, "rank": rank}) + "\n")


def _converged_then_started_again(run, t0):
    """Launch 1 trains from 8.0 down to ~0.1 by step 60; launch 2 starts from scratch."""
    _log(run, 0, [(s, 8.0 * 0.93 ** s) for s in range(61)], t0)
    run.append_event("rank_started", "rank-0", rank=0, pid=2)
    _log(run, 0, [(s, 8.0 * 0.93 ** s) for s in range(15)], time.time() + 1)


def test_a_launch_that_started_over_is_not_a_spike(tmp_path):
    run = RunDir(tmp_path / "exp1").create()
    _converged_then_started_again(run, time.time() - 100)
    # Across the restart step 0's 8.0 is ~50x the mean of the ten steps logged before it.
    assert first_bad_step(run, spike_factor=3) is None


def test_a_launch_that_kept_counting_steps_is_cut_at_its_rank_started(tmp_path):
    """A job that numbers steps from its data position, not its state: the journal's
    rank_started marks the new launch."""
    run = RunDir(tmp_path / "exp1").create()
    _log(run, 0, [(s, 8.0 * 0.93 ** s) for s in range(61)], time.time() - 100)
    run.append_event("rank_started", "rank-0", rank=0, pid=2)
    _log(run, 0, [(61 + s, 8.0 * 0.93 ** s) for s in range(15)], time.time() + 1)
    assert first_bad_step(run, spike_factor=3) is None


def test_a_resume_from_an_earlier_checkpoint_is_cut_where_the_step_goes_back(tmp_path):
    """No rank_started in the journal (a journal lost or rotated): the step going back
    still marks the new launch."""
    run = RunDir(tmp_path / "exp1").create()
    _log(run, 0, [(s, 8.0 * 0.9 ** s) for s in range(50)], time.time() - 100)
    _log(run, 0, [(s, 8.0 * 0.9 ** s) for s in range(20, 40)], time.time() - 50)
    assert first_bad_step(run, spike_factor=3) is None


def test_a_real_spike_after_a_restart_is_still_found(tmp_path):
    run = RunDir(tmp_path / "exp1").create()
    _converged_then_started_again(run, time.time() - 100)
    _log(run, 0, [(s, 1.0) for s in range(15, 27)], time.time() + 2)
    _log(run, 0, [(27, 9.0)], time.time() + 3)
    assert first_bad_step(run, spike_factor=3) == 27


def test_each_rank_is_compared_with_its_own_steps(tmp_path):
    """Rank 1's loss is 5x rank 0's throughout (its own micro-batches): not a spike."""
    run = RunDir(tmp_path / "exp1").create()
    t0 = time.time() - 100
    _log(run, 0, [(s, 0.2) for s in range(30)], t0)
    _log(run, 1, [(s, 1.0) for s in range(30)], t0)
    assert first_bad_step(run, spike_factor=3) is None
    _log(run, 1, [(30, 3.5)], t0 + 1)
    assert first_bad_step(run, spike_factor=3) == 30


def test_the_first_spike_alert_rolls_back_only_when_a_rank_logged_the_spike(tmp_path):
    run = RunDir(tmp_path / "exp1").create()
    _converged_then_started_again(run, time.time() - 100)
    controller = JobController(run.root, [sys.executable, "-c", "pass"], stop_grace_seconds=3)
    runner = ActionRunner(run.root, controller, Policy(min_interval_seconds=0))

    def spike(fingerprint):
        return ActionRequest("TrainingLossSpike", "rollback_skip", {"run": "exp1"},
                             fingerprint, "2026-12-07T10:00:00Z", "engine")

    try:
        first = runner.handle(spike("s1"))
        assert not first.taken and not first.final, first.reason
        assert "not confirmed" in first.reason and "same launch" in first.reason
        assert not run.events("action_taken") and not run.events("job_stopped")
        _log(run, 0, [(s, 1.0) for s in range(15, 27)] + [(27, 9.0)], time.time() + 2)
        second = runner.handle(spike("s2"))
        assert second.taken and second.details["bad_step"] == 27, second.reason
    finally:
        controller.stop("test teardown")


def test_only_the_recent_end_of_each_log_is_read(tmp_path, monkeypatch):
    """A million-step log is not read whole into the supervisor: a NaN logged long before
    the lookback is not what a loss alert asks about now."""
    from trainwatch.control import bad_step

    run = RunDir(tmp_path / "exp1").create()
    t0 = time.time() - 1000
    _log(run, 0, [(s, float("nan") if s == 3 else 1.0) for s in range(200)], t0)
    assert first_bad_step(run, spike_factor=3) == 3
    monkeypatch.setattr(bad_step, "LOOKBACK_BYTES", 60 * 120)  # the last ~60 lines
    assert first_bad_step(run, spike_factor=3) is None
    _log(run, 0, [(200, 7.0)], t0 + 10)
    assert first_bad_step(run, spike_factor=3) == 200


def test_a_step_that_recorded_no_loss_is_not_a_bad_step(tmp_path):
    """A loop that records its loss every 5th step: the others are not non-finite (the
    code before took the first of them for the bad step, and a rollback then quarantined
    every checkpoint since step 1)."""
    run = RunDir(tmp_path / "exp1").create()
    t0 = time.time() - 100
    with open(run.metrics_file(0), "a") as fh:
        for step in range(100):
            record = {"v": 1, "kind": "step", "step": step, "time": t0 + step * 0.01}
            if step % 5 == 0:
                record["loss"] = 2.0
            if step == 81:
                record["loss"] = None  # a tensor that could not be read
            fh.write(json.dumps(record) + "\n")
    assert first_bad_step(run, spike_factor=3) is None
    _log(run, 0, [(100, float("nan"))], t0 + 2)
    assert first_bad_step(run, spike_factor=3) == 100
