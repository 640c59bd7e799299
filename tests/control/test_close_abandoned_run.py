"""A run a node reboot left behind (ranks 'running', processes gone, no supervisor) pages
TrainingRankDown until someone ends it: diagnose says it is abandoned and that
`trainwatch close` ends it; close refuses while the job runs and, once it is gone, makes
the agent export the run as stopped (the rule's `unless supervisor_stopped`).

A real 2-rank job (examples/own_loop.py under torchrun, gloo on CPU, no supervisor) is
frozen and SIGKILLed whole, as a power cut would; the reboot is its ranks' files naming a
boot that is not this one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from agent_helpers import REPO, get_json, http_get, start_agent, stop_process, wait_for
from conftest import torchrun_env
from trainwatch.rundir.beat import encode, read_beat
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow
OTHER_BOOT = "00000000-0000-4000-8000-000000000000"


def _trainwatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainwatch", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def _steps(run: RunDir) -> list[int]:
    return [r.get("step") or 0 for r in run.statuses().records]


def _power_cut(job: subprocess.Popen) -> None:
    """Every process of the job at once: frozen first, so none hears of the others' end
    (no SIGTERM save, no status written on the way out), then killed."""
    pids = [job.pid] + [p.pid for p in psutil.Process(job.pid).children(recursive=True)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            os.kill(pid, sig)
    job.wait(30)
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                             for p in pids), 30, what="the job's processes gone")


def _rebooted(run: RunDir) -> None:
    """What the reboot changes in the files: the boot their writers ran in is not this one."""
    for rank in (0, 1):
        path = run.status_file(rank)
        status = json.loads(path.read_text())
        path.write_text(json.dumps(dict(status, boot=OTHER_BOOT)))
        beat_file = path.with_suffix(".beat")
        beat = read_beat(beat_file, run.root)
        with open(beat_file, "r+b") as fh:
            fh.write(encode(dict(beat, boot=OTHER_BOOT)))


def _stopped_gauge(url: str, job: str) -> float | None:
    text = http_get(url + "/metrics").decode()
    found = re.search(r'^trainwatch_run_supervisor_stopped\{[^}]*run="%s"[^}]*\} (\S+)$'
                      % re.escape(job), text, re.M)
    return float(found.group(1)) if found else None


def test_a_rebooted_run_is_named_abandoned_and_close_ends_its_page(tmp_path):
    run = RunDir(tmp_path / "rebooted")
    env = torchrun_env(tmp_path, TRAINWATCH_RUN_DIR=str(run.root))
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=2", "examples/own_loop.py", "--steps", "100000",
                            "--pace", "0.05"], env=env, cwd=REPO, start_new_session=True,
                           stdout=open(tmp_path / "job.log", "wb"), stderr=subprocess.STDOUT)
    agent = None
    try:
        wait_for(lambda: len(_steps(run)) == 2 and min(_steps(run)) >= 3, 120,
                 what="both ranks training")
        live = _trainwatch("close", str(run.root))
        assert live.returncode == 2, live.stdout + live.stderr
        assert "not closed: rank 0 (pid" in live.stderr and "still running here" in live.stderr
        _power_cut(job)
        _rebooted(run)

        agent, url = start_agent(tmp_path, "--run-dir", str(run.root))
        job_name = run.root.name
        wait_for(lambda: _stopped_gauge(url, job_name) == 0.0, 60, what="journal read")
        ranks = get_json(url + "/status")
        assert ranks  # the agent sees the run; both ranks down while not closed
        assert re.search(r'^trainwatch_rank_up\{[^}]*rank="0"[^}]*\} 0\.0$',
                         http_get(url + "/metrics").decode(), re.M)

        seen = _trainwatch("diagnose", str(run.root), "--json", "--no-dump-request")
        assert seen.returncode == 1, seen.stderr
        dead = [f for f in json.loads(seen.stdout)["findings"] if f["category"] == "rank_dead"]
        assert dead and all(f["next_command"] == f"trainwatch close {run.root}" for f in dead)
        said = " ".join(dead[0]["evidence"])
        assert "abandoned since its last heartbeat" in said and "no supervisor holds" in said
        assert "this node rebooted since rank(s) [0, 1] ran" in said

        closed = _trainwatch("close", str(run.root))
        assert closed.returncode == 0, closed.stderr
        assert "closed (its job is gone" in closed.stdout and "rebooted since" in closed.stdout
        wait_for(lambda: _stopped_gauge(url, job_name) == 1.0, 60,
                 what="the agent exporting the closed run as stopped")
        after = _trainwatch("diagnose", str(run.root), "--json", "--no-dump-request")
        assert after.returncode == 0, after.stdout[-3000:]
        assert json.loads(after.stdout)["findings"][0]["title"].startswith(
            "the run was closed by hand")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        if agent is not None:
            stop_process(agent)
