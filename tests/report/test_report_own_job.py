"""`trainwatch report` on an own job (`trainwatch run -- torchrun ... examples/own_loop.py`)
whose rank 1 is SIGKILLed: the incident names the rank and the signal from torchrun's
line in the job's own log (logs/job.log), not only "restart by the controller", and the
checkpoint hint knows the job's interval from its saves."""

import json
import os
import signal
import subprocess
import sys

import pytest

from agent_helpers import wait_for
from conftest import REPO, kill_tree
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow


def test_a_killed_rank_of_an_own_job_is_named_with_its_signal(tmp_path):
    run = RunDir(tmp_path / "run")
    (tmp_path / "agent.yaml").write_text("collectors:\n  ranks: {interval: 0.5}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", str(run.root), "--no-live",
         "--agent-config", str(tmp_path / "agent.yaml"), "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "examples" / "own_loop.py"), "--steps", "60", "--checkpoint-every", "10",
         "--pace", "0.1"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        def rank1_past_checkpoints():
            status = {s["rank"]: s for s in run.statuses().records}
            mine = status.get(1, {})
            return mine if (mine.get("step") or 0) >= 25 and mine.get("state") == "running" \
                else None
        victim = wait_for(rank1_past_checkpoints, 240, what="rank 1 past step 25")
        os.kill(victim["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    finally:
        kill_tree(proc)
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run.root),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    causes = [i["cause"] for i in data["incidents"]]
    assert len(causes) == 1 and "rank 1 killed by SIGKILL" in causes[0], causes
    assert data["checkpoint_hint"]["current_every_steps"] == 10, data["checkpoint_hint"]
