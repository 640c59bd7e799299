"""Ranks in a PID namespace of their own (a trainer pod without hostPID, issue #34): the
agent finds each rank's host process by the namespace and pid the rank publishes.

A real rank-like process (the rank library's own first status, `initial_status`) runs as
pid 1 of a new PID namespace (`unshare --pid --fork --mount-proc`, root only). Before,
the agent looked up the published pid on the host: pid 1 is the host's init, so the rank
was "gone" (TrainingRankDown for a healthy rank), and a namespaced pid that equals a live
host pid was claimed as the rank's process.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

from agent_helpers import REPO, collector, kill_pids, make_ctx, wait_for, write_status
from users_helpers import _python_for_others
from trainwatch.rundir.run_dir import RunDir

RUNUSER = shutil.which("runuser")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not RUNUSER,
                                reason="needs root, unshare and runuser")

# The rank's first status, as the rank library writes it, then nothing: it sleeps.
RANK = """
import sys, time, psutil
from trainwatch.rank.status import initial_status
from trainwatch.rundir.run_dir import RunDir
RunDir(sys.argv[1]).write_status(0, initial_status(
    job="exp", rank=0, local_rank=0, world_size=2, device="cpu", heartbeat_interval=1.0,
    restart_count=0, process=psutil.Process()))
time.sleep(600)
"""


@pytest.fixture
def namespaced_rank(tmp_path):
    """(run dir, the rank's host pid) of a rank that is pid 1 of its own PID namespace."""
    run = RunDir(tmp_path / "exp").create()
    env = {k: v for k, v in os.environ.items() if k != "TRAINWATCH_NODE"}
    env["PYTHONPATH"] = str(REPO)
    unshare = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                                "-c", RANK, str(run.root)], env=env, start_new_session=True)
    try:
        wait_for(lambda: run.status_file(0).exists(), timeout=30)
        (child,) = psutil.Process(unshare.pid).children()
        yield run, child.pid
    finally:
        kill_pids([p.pid for p in psutil.Process(unshare.pid).children()]
                  if unshare.poll() is None else [])
        unshare.wait(10)


def _look(ranks) -> dict:
    ranks.options["process_every"] = 0.0  # every collection looks at the processes now
    return {r["rank"]: r for r in ranks.collect().data["jobs"][0]["ranks"]}


def test_a_rank_in_its_own_pid_namespace_is_found_alive_stopped_and_dead(namespaced_rank):
    run, host_pid = namespaced_rank
    (status,) = run.statuses().records
    assert status["pid"] == 1 and status["pid_namespace"] != os.stat("/proc/self/ns/pid").st_ino
    # A status of another rank naming a live host pid (this test's) in that namespace,
    # where no process has it: not claimed.
    write_status(run, 1, os.getpid(), pid_namespace=status["pid_namespace"],
                 node=status["node"], process_created_at=psutil.Process().create_time())
    ranks = collector(make_ctx([run.root]), "ranks")
    seen = _look(ranks)
    assert seen[0]["pid"] == host_pid and seen[0]["pid_in_namespace"] == 1, seen[0]
    assert seen[0]["process"]["status"] in ("running", "sleeping"), seen[0]["process"]
    assert seen[1]["pid"] is None and seen[1]["process"] == {"status": "gone"}, seen[1]
    # An agent that may not read root's namespace links (no SYS_PTRACE) cannot tell: unknown.
    python, pythonpath = _python_for_others()
    asked = subprocess.run(
        [str(RUNUSER), "-u", "nobody", "--", python, "-c", "import sys; from trainwatch.host."
         "pid_namespace import HostPids; print(HostPids().host_pid(1, int(sys.argv[1])))",
         str(status["pid_namespace"])], env={"PYTHONPATH": pythonpath},
        capture_output=True, text=True, timeout=60)
    assert asked.stdout.strip() == "(None, 'unknown')", asked.stdout + asked.stderr
    os.kill(host_pid, signal.SIGSTOP)
    wait_for(lambda: _look(ranks)[0]["process"]["status"] == "stopped", timeout=30)
    os.kill(host_pid, signal.SIGKILL)  # ends a stopped process too
    wait_for(lambda: _look(ranks)[0]["process"]["status"] == "gone", timeout=30)
    assert _look(ranks)[0]["pid"] == host_pid  # the same process, now gone: dead at once
