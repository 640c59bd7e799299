"""A rank that dies on bad input is not restarted: torchrun exits 1 for it, but the
rank's status says bad_input, so `trainwatch run` ends at once with exit 2 naming the key
(before, the supervisor restarted it until the restart guard paged)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainwatch.rundir import RunDir

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
    exited = run.events("job_exited")
    assert len(exited) == 1 and "every_step" in exited[0]["bad_input"], exited
    assert not run.events("action_taken") and not run.events("action_skipped")
    status = {s["rank"]: s for s in run.statuses().records}[0]
    assert status["state"] == "failed" and status["failure"]["kind"] == "bad_input", status
