"""The supervisor collector: the node agent sees a frozen, dead or hung supervisor.

A real child process stands for the supervisor: it takes the run's lock as ``trainwatch
run`` does and writes its heartbeat (``rundir/supervisor_beat.py``); the test SIGSTOPs,
resumes, kills it, and lets it stop cleanly. What must export nothing: a lock holder that
writes no heartbeat (``trainwatch train`` by hand), another host's supervisor, a run its
journal says was stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from agent_helpers import collector, make_ctx, publish, samples, start_supervisor, wait_for
from trainwatch.agent.status import build_status
from trainwatch.agent.collectors.supervisor import BUSY_STALE_SECONDS, stale_verdict
from trainwatch.rundir.beat import BeatWriter
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import Holder

UP = "trainwatch_run_supervisor_up"
AGE = "trainwatch_run_supervisor_heartbeat_age_seconds"

def new_run(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "run").create()
    run.write_run_info({"job": "exp1"})
    return run


def look(col) -> tuple[dict, dict]:
    result = col.collect()
    return samples(result, UP), result.data


def verdict(col, run: RunDir) -> dict:
    return col.collect().data.get(str(run.root), {})


def health(ctx, col) -> tuple[str, list[str]]:
    """The node's health in /status after one more look at the supervisor."""
    publish(ctx, "supervisor", col.collect())
    status = build_status(ctx, listen="127.0.0.1:0", config_loaded_at=0.0)
    return status["health"], status["health_reasons"]


def test_up_frozen_resumed_then_dead(tmp_path):
    run = new_run(tmp_path)
    ctx = make_ctx([run.root])
    col = collector(ctx, "supervisor")
    proc = start_supervisor(run)
    try:
        ups, data = look(col)
        assert ups == {(("node", "node-a"), ("run", "exp1")): 1.0}
        seen = data[str(run.root)]
        assert seen["state"] == "running" and seen["pid"] == proc.pid
        assert samples(col.collect(), AGE)[(("node", "node-a"), ("run", "exp1"))] < 20

        os.kill(proc.pid, signal.SIGSTOP)
        frozen = wait_for(lambda: (v := verdict(col, run))["state"] == "frozen" and v, 10,
                          interval=0.1, what="the frozen supervisor")
        assert frozen["up"] is False and frozen["process_status"] == psutil.STATUS_STOPPED
        assert look(col)[0] == {(("node", "node-a"), ("run", "exp1")): 0.0}
        # /status says it too, critical: with trainwatch run alone nothing else may.
        state, reasons = health(ctx, col)
        assert state == "critical"
        assert [r for r in reasons if f"supervisor (pid {proc.pid}" in r
                and "is frozen" in r and "TrainwatchSupervisorDown" in r]

        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: verdict(col, run)["state"] == "running", 10, interval=0.1,
                 what="the resumed supervisor")
        assert health(ctx, col)[0] == "ok"

        os.kill(proc.pid, signal.SIGKILL)
        wait_for(lambda: verdict(col, run)["state"] == "dead", 10, interval=0.1,
                 what="the killed supervisor (a zombie until reaped)")
        proc.wait(10)
        dead = verdict(col, run)
        assert dead["state"] == "dead" and dead["process_status"] == "gone"
        assert look(col)[0] == {(("node", "node-a"), ("run", "exp1")): 0.0}
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_a_clean_stop_exports_nothing(tmp_path):
    run = new_run(tmp_path)
    col = collector(make_ctx([run.root]), "supervisor")
    proc = start_supervisor(run)
    try:
        assert look(col)[0]
        proc.terminate()
        assert proc.wait(10) == 0
        assert look(col) == ({}, {})  # the lock record is emptied: nothing to page
    finally:
        proc.kill()
        proc.wait(10)


def test_a_run_its_journal_says_was_stopped_exports_nothing(tmp_path):
    """A supervisor killed after it journaled its stop (controller_stopped): the run is over."""
    run = new_run(tmp_path)
    ctx = make_ctx([run.root])
    proc = start_supervisor(run)
    try:
        run.append_event("controller_started", "supervisor")
        run.append_event("controller_stopped", "supervisor", exit_code=0)
        publish(ctx, "journal", collector(ctx, "journal").collect())
        proc.kill()
        proc.wait(10)
        assert look(collector(ctx, "supervisor")) == ({}, {})
    finally:
        proc.kill()
        proc.wait(10)


def test_a_holder_without_heartbeat_is_not_watched(tmp_path):
    """trainwatch train by hand holds the lock but has no repair to lose: dead or frozen, it
    pages nothing of its own (its ranks' alerts say the rest)."""
    run = new_run(tmp_path)
    col = collector(make_ctx([run.root]), "supervisor")
    proc = start_supervisor(run, role="trainwatch train", beat=False)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        assert look(col) == ({}, {})
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def _record(run: RunDir, holder: Holder, at: float) -> None:
    run.supervisor_lock_file.write_text(json.dumps(holder.to_json()) + "\n")
    writer = BeatWriter(run.supervisor_beat_file)
    writer.write({"pid": holder.pid, "host": holder.host, "token": holder.token, "at": at})
    writer.close()


def test_another_hosts_supervisor_is_judged_there_only(tmp_path):
    run = new_run(tmp_path)
    holder = Holder(pid=1, host="another-host", started_at=0.0, token="t" * 32,
                    role="trainwatch run", since=time.time())
    _record(run, holder, time.time() - 3600)
    assert look(collector(make_ctx([run.root]), "supervisor")) == ({}, {})


def _child_holder(code: str) -> tuple[subprocess.Popen, Holder]:
    """A real process standing for a supervisor whose heartbeat thread stopped: ``code``
    says what it does meanwhile (sleep: blocked; a loop: busy on a CPU)."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    holder = Holder(pid=proc.pid, host=socket.gethostname(),
                    started_at=psutil.Process(proc.pid).create_time(), token="h" * 32,
                    role="trainwatch run", since=time.time())
    return proc, holder


def test_a_blocked_supervisor_whose_heartbeat_stopped_is_hung(tmp_path):
    """Its process runs (not stopped) but uses no CPU and its heartbeat is 60 s old: hung,
    down, though only once a second look saw it idle (no verdict on one sample)."""
    run = new_run(tmp_path)
    proc, holder = _child_holder("import time; time.sleep(600)")
    try:
        _record(run, holder, time.time() - 60)
        col = collector(make_ctx([run.root]), "supervisor")
        assert look(col)[0] == {(("node", "node-a"), ("run", "exp1")): 1.0}  # one look
        hung = wait_for(lambda: (v := verdict(col, run))["state"] == "hung" and v, 10,
                        interval=0.3, what="the hung verdict on a second look")
        assert hung["up"] is False and hung["heartbeat_age_seconds"] >= 60
        assert look(col)[0] == {(("node", "node-a"), ("run", "exp1")): 0.0}
        _record(run, holder, time.time())
        assert look(col)[0] == {(("node", "node-a"), ("run", "exp1")): 1.0}
        # A beat of another holder (the one before it) is not this one's.
        _record(run, Holder.me("trainwatch run"), time.time())
        run.supervisor_lock_file.write_text(json.dumps(holder.to_json()) + "\n")
        assert look(col) == ({}, {})
    finally:
        proc.kill()
        proc.wait(10)


def test_a_busy_supervisor_is_not_down_until_its_heartbeat_is_very_old(tmp_path):
    """A supervisor that spins on a CPU (a C call holding the GIL, a loaded machine) while
    its heartbeat is 60 s old is busy, not frozen: up. Past BUSY_STALE_SECONDS it repairs
    nothing either: hung."""
    run = new_run(tmp_path)
    proc, holder = _child_holder("while True:\n    pass\n")
    try:
        _record(run, holder, time.time() - 60)
        col = collector(make_ctx([run.root]), "supervisor")
        busy = wait_for(lambda: (v := verdict(col, run))["state"] == "busy" and v, 20,
                        interval=0.6, what="the busy verdict")
        assert busy["up"] is True
        assert look(col)[0] == {(("node", "node-a"), ("run", "exp1")): 1.0}
        _record(run, holder, time.time() - BUSY_STALE_SECONDS - 1)
        assert verdict(col, run)["state"] == "hung"
        assert look(col)[0] == {(("node", "node-a"), ("run", "exp1")): 0.0}
    finally:
        proc.kill()
        proc.wait(10)


def test_a_stale_heartbeat_is_judged_by_the_cpu_the_process_used():
    assert stale_verdict(30, None) == "running"      # one look: no verdict yet
    assert stale_verdict(30, 0.0) == "hung"          # blocked, deadlocked
    assert stale_verdict(30, 0.95) == "busy"         # spinning
    assert stale_verdict(BUSY_STALE_SECONDS + 1, 0.95) == "hung"
    assert stale_verdict(BUSY_STALE_SECONDS + 1, None) == "hung"
    # a look too soon after the last to measure keeps the verdict it had
    assert stale_verdict(30, None, previous="hung") == "hung"
    assert stale_verdict(30, None, previous="busy") == "busy"
    assert stale_verdict(30, None, previous="frozen") == "running"


def test_a_multi_node_jobs_supervisor_is_judged_by_its_own_nodes_agent(tmp_path):
    """One supervisor per node on the shared run directory: node-a's agent watches
    node-a's (frozen: down), never node-b's."""
    run = new_run(tmp_path)
    col = collector(make_ctx([run.root]), "supervisor")  # the agent of node-a
    other = start_supervisor(run, node="node-b")
    try:
        assert look(col)[0] == {}  # node-b's supervisor is node-b's agent's to judge
        mine = start_supervisor(run, node="node-a")
        try:
            assert look(col)[0] == {(("node", "node-a"), ("run", "exp1")): 1.0}
            assert verdict(col, run)["pid"] == mine.pid
            os.kill(mine.pid, signal.SIGSTOP)
            wait_for(lambda: verdict(col, run)["state"] == "frozen", 10, interval=0.1,
                     what="node-a's frozen supervisor")
        finally:
            os.kill(mine.pid, signal.SIGCONT)
            mine.kill()
            mine.wait(10)
    finally:
        other.kill()
        other.wait(10)
