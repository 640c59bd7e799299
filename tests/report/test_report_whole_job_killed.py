"""`kill -9` of a whole `trainwatch run` job (supervisor, launcher and ranks together, as a
node reboot does) then a new start: the time between is not a stall (ranks alive, not
progressing) but time nothing ran, and the new start's way to its first step is that
incident's restart downtime. Measured on a real run (2 gloo ranks, the whole tree
SIGKILLed, restarted 20 s later): 29.3 s of 53 s were booked "stalled" before."""

import pytest

from report_helpers import T0, Run, assert_sums_to_wall, near, report_json


def _killed_with_its_job(root, *, beat_before_last_step, hang=0.0, beat=True):
    """Controller, launcher, 2 ranks; steps 0-14 of 1 s; the whole tree SIGKILLed right
    after step 14 (its supervisor's last beat ``beat_before_last_step`` s before that
    step's end; ``hang``: the ranks hung that long before the kill, the supervisor
    beating on); 20 s later a new `trainwatch run` resumes from step 10."""
    r = Run(root)
    r.event("controller_started", "engine")
    r.event("job_started", "engine", pid=50, reason="trainwatch run", attempt=1)
    r.event("launcher_started", "launcher", pid=50)
    r.wait(1)
    r.attempt(0)
    r.rank_event("run_started", world_size=2, start_step=0, steps=30)
    r.steps(0, 14)
    last_step = r.clock
    beat_at = last_step - beat_before_last_step
    r.wait(hang + 20)
    r.event("supervisor_died", "supervisor",
            previous={"pid": 40, "host": "h", "role": "trainwatch run", "since": T0},
            node=None, last_beat_at=T0 + beat_at if beat else None)
    r.event("controller_started", "engine")
    restarted = r.clock
    r.event("job_started", "engine", pid=60, reason="trainwatch run", attempt=1)
    r.event("launcher_started", "launcher", pid=60)
    r.wait(3)
    r.attempt(0)
    r.rank_event("checkpoint_resumed", step=10)
    r.wait(1)
    first_step = r.clock
    r.steps(10, 29)
    r.rank_event("finished", step=29, steps=30)
    r.event("launcher_exited", "launcher", exit_code=0)
    r.event("job_exited", "engine", pid=60, returncode=0)
    r.event("controller_stopped", "engine", exit_code=0)
    return r, last_step, max(last_step, beat_at), restarted, first_step


@pytest.mark.parametrize("beat", [True, False])
def test_the_time_after_a_whole_job_was_killed_is_not_running_not_stalled(tmp_path, beat):
    """The supervisor's last beat came 0.4 s before the last step (it beats once a second):
    the job was last alive at that step; then nothing ran until the new start. Without a
    beat the job's last sign of life is all there is, and says the same."""
    r, last_step, died, restarted, first_step = _killed_with_its_job(
        tmp_path / "run", beat_before_last_step=0.4, beat=beat)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    assert data["categories"]["stalled"] == 0, data["categories"]
    assert died == last_step
    assert data["time"]["not_running_seconds"] == near(restarted - died)
    (incident,) = data["incidents"]
    assert incident["time"] == near(T0 + died)
    assert incident["stalled_seconds"] == 0
    assert incident["restart_downtime_seconds"] == near(first_step - restarted)
    assert incident["cause"].startswith("its supervisor (pid 40) died without a word")


def test_a_hang_the_supervisor_watched_until_the_kill_is_still_a_stall(tmp_path):
    """The ranks hung 30 s (past the 10 s budget) while the supervisor beat on, then the
    whole tree was killed: that silence was a stall, up to the supervisor's last beat."""
    r, last_step, died, restarted, _ = _killed_with_its_job(
        tmp_path / "run", beat_before_last_step=-29.0, hang=30.0)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    assert died == near(last_step + 29.0)
    assert data["categories"]["stalled"] == near(29.0)
    assert data["time"]["not_running_seconds"] == near(restarted - died)
