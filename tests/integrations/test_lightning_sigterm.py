"""Lightning DDP (2 CPU ranks under torchrun) stopped the way Slurm stops a job: SIGTERM to
every process of the step at once, so each rank gets it twice within milliseconds (its own,
and torchrun's forward). Lightning's SIGTERM handler runs a broadcast inside the handler;
the second one landed in the middle of the callback's stop save, the ranks' collectives
no longer matched and a rank died ("Connection reset by peer"): nothing saved. The
callback now takes SIGTERM itself (no collective in a handler, a repeat within 2 s is the
same stop), saves and exits 75 like ``Checkpoints``."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_helpers import wait_for
from conftest import kill_tree
from trainwatch.checkpoint_format.manifest import verify
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.checkpoint.checkpointer import EXIT_STOPPED

pytestmark = pytest.mark.slow
JOB = Path(__file__).resolve().parent.parent / "jobs" / "lightning_job.py"


def _stop(tmp_path, signal_torchrun, late=False):
    """Run the job; once both ranks trained a few steps SIGTERM both (and torchrun), and rank
    0 again 20 ms later; ``late``: rank 0 alone, rank 1 SIGTERMs itself while it writes its
    final status. The run directory and the launcher's output."""
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("not installed: lightning")
    run = RunDir(tmp_path / "run")
    log = tmp_path / "job.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(JOB), "400", "0.1"], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRAINWATCH_RUN_DIR": str(run.root),
             **({"LATE_SIGTERM": "1"} if late else {})})
    try:
        def running():
            status = {s["rank"]: s for s in run.statuses().records}
            return len(status) == 2 and all((s.get("step") or 0) >= 3 for s in status.values())\
                and status
        status = wait_for(running, timeout=240, what="both ranks past step 3")
        pids = [status[r]["pid"] for r in ((0,) if late else (0, 1))]
        pids += [proc.pid] if signal_torchrun else []
        for pid in pids:  # Slurm's SIGTERM to every process of the step
            os.kill(pid, signal.SIGTERM)
        if not late:
            time.sleep(0.02)
            os.kill(pids[0], signal.SIGTERM)  # a copy that reached rank 0 alone (forwarded)
        proc.wait(timeout=120)
    finally:
        kill_tree(proc)
    return run, log.read_text()


def test_sigterm_to_every_process_of_the_step_saves_once(tmp_path):
    run, text = _stop(tmp_path, signal_torchrun=True)
    saved = run.events("checkpoint_saved")
    assert [e["reason"] for e in saved] == ["stop"], text[-3000:]
    assert verify(saved[0]["path"]).ok
    assert {s["state"] for s in run.statuses().records} == {"stopped"}, text[-3000:]
    assert "Connection reset by peer" not in text


def test_the_ranks_exit_75_stopped_resume_me_not_0_finished(tmp_path):
    """Lightning's own SIGTERMException exits 0, which `trainwatch run` reads as a finished
    job: it would not be restarted to resume. Rank 0 alone is asked; rank 1 carries the stop
    out and gets its own (its launcher's) SIGTERM while it writes its final status: the
    callback had given SIGTERM back to Lightning's handler, whose broadcast inside the
    handler left rank 1 'running' (exit -15 or a broken collective)."""
    run, text = _stop(tmp_path, signal_torchrun=False, late=True)
    assert [e["reason"] for e in run.events("checkpoint_saved")] == ["stop"], text[-3000:]
    assert {s["rank"]: s["state"] for s in run.statuses().records} == {
        0: "stopped", 1: "stopped"}, text[-3000:]
    assert f"exitcode  : {EXIT_STOPPED}" in text, text[-3000:]
