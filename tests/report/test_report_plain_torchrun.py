"""`trainwatch report` on a run launched with plain torchrun (no `trainwatch run`, so no
supervisor journals how it ended) whose rank 1 is SIGKILLed: the ranks' statuses still say
running, but their processes are gone. The run has ended, with an incident naming the rank
that fell silent first, not "running, no incidents"."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, torchrun_env
from trainwatch.node import node_name
from trainwatch.report.vanished import vanished

pytestmark = pytest.mark.slow


def test_a_killed_rank_of_a_plain_torchrun_run_is_an_incident_not_a_running_run(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(REPO / "tests" / "jobs" / "killed_peer_job.py"), "30", "15", "0"],
        env=torchrun_env(tmp_path, TRAINWATCH_RUN_DIR=str(run_dir)), capture_output=True,
        text=True, timeout=180, cwd=REPO)
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run_dir),
                             "--json"], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["state"] == "ended", data["state"]
    (incident,) = data["incidents"]
    assert "rank 1 fell silent first" in incident["cause"] or \
        incident["cause"].startswith("rank 1 (pid"), incident["cause"]


def test_only_a_rank_of_this_node_whose_process_is_gone_has_vanished():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = {"state": "running", "node": node_name(), "step": 5}
    statuses = [{**here, "rank": 0, "pid": os.getpid()},                  # alive: us
                {**here, "rank": 1, "pid": gone.pid},                     # gone
                {**here, "rank": 2, "pid": gone.pid, "node": "elsewhere"},  # cannot look
                {**here, "rank": 3, "pid": gone.pid, "state": "finished"},  # said its word
                {**here, "rank": 4, "pid": os.getpid(), "process_created_at": 1.0}]  # reused
    assert [x["rank"] for x in vanished(statuses)] == [1, 4]
