"""`trainwatch diagnose` on a run its user stopped (Ctrl-C on `trainwatch run`) whose job
does not save on SIGTERM (telemetry only, tests/jobs/diagnose_job.py): its ranks die by
the signal with statuses still saying "running". That is the stop the journal records,
not two ranks that died at once: no critical finding, exit 0, the stop named."""

import signal
import subprocess
import sys

import pytest

from agent_helpers import wait_for
from conftest import REPO, kill_tree, torchrun_env
from diagnose_helpers import JOB, diagnose
from trainwatch.rundir import RunDir

pytestmark = pytest.mark.slow


def test_a_run_stopped_with_ctrl_c_is_stopped_not_dead(tmp_path):
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
    assert {s["state"] for s in run.statuses().records} == {"running"}  # no save on SIGTERM
    code, report, text = diagnose(run)
    assert code == 0, text
    assert not [f["title"] for f in report["findings"] if f["severity"] != "info"], text
    top = report["findings"][0]
    assert "stopped" in top["title"] and "interrupted" in top["title"], top
    assert not [f for f in report["findings"] if f["category"] == "rank_dead"], text
