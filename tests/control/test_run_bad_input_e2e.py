"""A rank that dies on bad input is not restarted: torchrun exits 1 for it, but the
rank's status says bad_input, so `trainwatch run` ends at once with exit 2 naming the key
(before, the supervisor restarted it until the restart guard paged)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parents[1] / "jobs" / "bad_input_job.py"


def test_a_misspelt_setting_in_a_users_loop_is_exit_2_not_a_restart_loop(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run.root), "--no-live",
         "--", "torchrun", "--standalone", "--nproc-per-node", "1", str(JOB)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = "rank 0: Checkpoints.from_env(), key 'Checkpoints.from_env.every_step': unknown"
    assert f"rejected its input (exit 2): {said}" in proc.stderr, proc.stderr
    assert len(run.events("job_started")) == 1, run.events("job_started")
    # It ended by itself (job_exited) or the supervisor stopped it on reading the status
    # first (job_stopped): either way once, saying why.
    ended = run.events("job_exited") + run.events("job_stopped")
    assert len(ended) == 1 and "every_step" in (ended[0].get("bad_input")
                                                or ended[0]["reason"]), ended
    assert not run.events("action_taken") and not run.events("action_skipped")
    status = {s["rank"]: s for s in run.statuses().records}[0]
    assert status["state"] == "failed" and status["failure"]["kind"] == "bad_input", status


def test_bad_input_under_torchruns_own_restarts_stops_the_job_instead_of_waiting(tmp_path):
    """With torchrun's --max-restarts 3, torchrun restarts a rank that died on bad input in
    place, again and again, and exits only when its restarts are spent: the supervisor
    reads the rank's bad_input status while torchrun runs and stops the job (it looks each
    second: one in-place restart may have begun by then), exit 2 naming the key."""
    run = RunDir(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run.root), "--no-live",
         "--", "torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
         str(JOB)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rejected its input (exit 2): rank " in proc.stderr, proc.stderr
    assert "every_step" in proc.stderr, proc.stderr
    restarts = {e["restart_count"] for e in run.events("rank_started")}
    assert max(restarts) <= 1, f"torchrun restarted the ranks {max(restarts)} times"
    assert len(run.events("job_started")) == 1, run.events("job_started")
    stopped = run.events("job_stopped")
    assert len(stopped) == 1 and "bad input" in stopped[0]["reason"], stopped
    assert not run.events("action_taken") and not run.events("action_skipped")
