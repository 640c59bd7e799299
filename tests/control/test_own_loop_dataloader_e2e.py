"""Ctrl-C on `trainwatch run -- torchrun ...` of a loop whose DataLoader has worker
processes: torchrun stops each rank with SIGTERM to the rank's whole process group, so
the loader's workers must be out of it (docs/own-trainer.md, `worker_init_fn`) for the
rank to save on the way out; in it, the rank dies in its loader with no checkpoint."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from agent_helpers import wait_for
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parents[1] / "jobs" / "dataloader_job.py"


def _interrupted_run(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run_dir), "--no-live",
           "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB)]
    log = tmp_path / "run.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        def stepping():
            status = json.loads((run_dir / "status" / "rank-00001.json").read_text())
            return (status.get("steps_completed") or 0) >= 5
        wait_for(stepping, timeout=120, what="rank 1 past step 5")
        pids = [s["pid"] for s in RunDir(run_dir).statuses().records]
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, RunDir(run_dir), log.read_text()[-3000:], pids


def test_ctrl_c_saves_with_dataloader_workers(tmp_path):
    """Also what any Ctrl-C on `trainwatch run` must do: a soft stop of the job (SIGTERM,
    which made it checkpoint), journaled as interrupted, exit 130, and nothing it started
    (the agent, torchrun, a rank) outlives it."""
    code, run, log, pids = _interrupted_run(tmp_path)
    assert code == 130, log
    saves = [e for e in run.events("checkpoint_saved") if e.get("reason") == "stop"]
    assert saves, f"no checkpoint saved on Ctrl-C\n{log}"
    stopped = run.events("job_stopped")
    assert stopped and stopped[-1]["reason"] == "interrupted", stopped
    assert not stopped[-1]["hard"], stopped
    controller = run.events("controller_stopped")[-1]
    assert controller["interrupted"] and controller["exit_code"] == 130, controller
    job_log = (run.logs_dir / "job.log").read_text()
    assert "DataLoader worker" not in job_log, job_log[-3000:]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if str(run.root) in " ".join(p.info["cmdline"] or [])]
    assert not left, left
