"""`trainwatch report` on a run its user stopped (Ctrl-C on `trainwatch run`) whose job
does not save on SIGTERM (telemetry only, tests/jobs/diagnose_job.py): the incident says
the supervisor stopped it and that nothing was saved on the stop, not the bare journal
event ("job_stopped with exit code 1"); the closing summary says the same."""

import json
import signal
import subprocess
import sys

import pytest

from agent_helpers import wait_for
from conftest import REPO, kill_tree, torchrun_env
from trainwatch.rundir import RunDir

pytestmark = pytest.mark.slow
JOB = str(REPO / "tests" / "jobs" / "diagnose_job.py")


def test_a_run_stopped_with_ctrl_c_says_who_stopped_it(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", str(run.root), "--no-live", "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", JOB, str(run.root), "100000"],
        env=torchrun_env(tmp_path, STEP_SLEEP="0.05"), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(run.statuses().records) == 2 and all(
            (s.get("steps_completed") or 0) >= 10 for s in run.statuses().records), 180,
            what="both ranks past step 10")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, out[-3000:]
    finally:
        kill_tree(proc)
    assert "stopped by its supervisor" in out and "job_stopped with" not in out, out
    said = "stopped by its supervisor (interrupted); nothing saved on the stop"
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run.root),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    causes = [i["cause"] for i in json.loads(done.stdout)["incidents"]]
    assert causes == [said], causes
