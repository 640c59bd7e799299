"""`trainwatch report` on an own job whose rank 1 is SIGKILLed while rank 0 finishes a slow
batch (tests/jobs/killed_peer_job.py, under `trainwatch run -- torchrun`): rank 0 defers
torchrun's SIGTERM to the end of its step, so the attempt ends seconds after the death.
That silence is teardown after a death torchrun saw at once (restart downtime), not a
stall: the incident is rank 1 killed by SIGKILL with no stalled seconds."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, kill_tree
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow
SLOW_S = 8  # longer than the 5 s stall budget of these short steps


def test_a_killed_rank_is_not_charged_as_a_stall_while_its_peer_tears_down(tmp_path):
    run = RunDir(tmp_path / "run")
    (tmp_path / "agent.yaml").write_text("collectors:\n  ranks: {interval: 0.5}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", str(run.root), "--no-live",
         "--agent-config", str(tmp_path / "agent.yaml"), "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests" / "jobs" / "killed_peer_job.py"), "30", "15", str(SLOW_S)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    finally:
        kill_tree(proc)
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run.root),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    incidents = data["incidents"]
    assert len(incidents) == 1 and "rank 1 killed by SIGKILL" in incidents[0]["cause"], \
        incidents
    assert incidents[0]["stalled_seconds"] == 0, incidents[0]
    assert data["categories"]["stalled"] == 0, data["categories"]
    # The seconds rank 0 took to stop are the incident's downtime instead.
    assert incidents[0]["restart_downtime_seconds"] >= SLOW_S - 2, incidents[0]
