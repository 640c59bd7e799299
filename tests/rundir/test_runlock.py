"""The run directory's lock (trainwatch/rundir/runlock.py) and children that die with their parent
(trainwatch/process/proctree.py), with real processes: one holder at a time, a killed holder's lock
free at once, its leftovers found by their mark and stopped, never a process that is not
provably ours; a child started from a short-lived thread lives on after that thread ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from agent_helpers import wait_for
from conftest import fill_to_the_brim, tmpfs_mount
from trainwatch.contract.env import SUPERVISOR_ENV
from trainwatch.errors import ConfigError
from trainwatch.process.proctree import spawn
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import Holder, acquire, hold, under_holder

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]

# Holds the run's lock in a process of its own (as `trainwatch run` does), starts a child
# that carries its mark, says "ready", and waits to be killed.
HOLDER = """
import subprocess, sys, time
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import hold
lock = hold(RunDir(sys.argv[1]), "test holder", *sys.argv[2:])  # [node]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path / "exp")


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _holder(run, procs, node: str | None = None) -> tuple[subprocess.Popen, int]:
    env = {k: v for k, v in os.environ.items() if k != SUPERVISOR_ENV}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run.root),
                             *([node] if node else [])],
                            stdout=subprocess.PIPE, text=True, env=env)
    procs.append(proc)
    child = int(proc.stdout.readline())
    procs.append(_Pid(child))
    return proc, child


class _Pid:
    """A finalizer entry for a process that is not our child."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        try:
            return None if psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE else 0
        except psutil.NoSuchProcess:
            return 0

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self):
        pass


def test_a_second_holder_is_refused_naming_the_first_and_a_released_lock_is_free(run):
    lock = acquire(run, "trainwatch run")
    try:
        assert os.environ[SUPERVISOR_ENV] == lock.holder.token  # children inherit the mark
        record = json.loads(run.supervisor_lock_file.read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        with pytest.raises(ConfigError, match=f"pid {os.getpid()} on host "
                                              f"{socket.gethostname()} \\(trainwatch run"):
            acquire(run, "trainwatch run")
    finally:
        lock.release()
    assert SUPERVISOR_ENV not in os.environ
    assert run.supervisor_lock_file.read_bytes() == b""  # a clean end leaves no record
    again = acquire(run, "trainwatch run")
    assert again.previous is None
    again.release()


def test_a_killed_holders_lock_is_free_at_once_and_its_marked_leftovers_are_stopped(run, procs):
    holder, child = _holder(run, procs)
    with pytest.raises(ConfigError, match=f"pid {holder.pid} on host"):
        acquire(run, "trainwatch run")
    bystander = subprocess.Popen(SLEEP)  # same user, same command, no mark: never touched
    procs.append(bystander)
    holder.kill()
    holder.wait()
    started = time.monotonic()
    lock = hold(run, "trainwatch run")
    try:
        assert time.monotonic() - started < 10
        assert lock.previous is not None and lock.previous.pid == holder.pid
        wait_for(lambda: _Pid(child).poll() is not None, 5, what="the leftover to end")
        (event,) = run.events("leftovers_stopped")
        assert [p["pid"] for p in event["processes"]] == [child]
        assert event["previous"]["pid"] == holder.pid and event["left"] == []
        assert bystander.poll() is None
        # Its death is on record before anything else (report names it, not "a stop").
        (died,) = run.events("supervisor_died")
        assert died["previous"]["pid"] == holder.pid and died["time"] <= event["time"]
    finally:
        lock.release()


def test_a_record_whose_pid_now_belongs_to_another_process_is_not_its_holder(run, procs):
    """pid reuse: the record's pid is alive, but started at another time: not the holder."""
    other = subprocess.Popen(SLEEP)
    procs.append(other)
    stale = Holder(pid=other.pid, host=socket.gethostname(), started_at=1.0, token="t" * 32,
                   role="trainwatch run", since=1.0)
    run.create()
    run.supervisor_lock_file.write_text(json.dumps(stale.to_json()))
    assert not stale.alive()
    lock = hold(run, "trainwatch run")
    try:
        assert lock.previous == stale
        assert other.poll() is None  # it does not carry the stale token: left alone
        assert not run.events("leftovers_stopped")
    finally:
        lock.release()


def test_a_live_holder_that_lost_its_lock_file_still_refuses_a_second(run):
    lock = acquire(run, "trainwatch run")
    try:
        record = run.supervisor_lock_file.read_bytes()
        run.supervisor_lock_file.unlink()  # removed by hand: the flock is on a gone inode
        run.supervisor_lock_file.write_bytes(record)
        with pytest.raises(ConfigError, match="still runs although it no longer holds"):
            acquire(run, "trainwatch run")
    finally:
        lock.release()


def test_a_symlink_or_fifo_as_the_lock_file_is_exit_2(run, tmp_path):
    run.create()
    run.supervisor_lock_file.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="supervisor.lock"):
        acquire(run, "trainwatch run")
    assert not (tmp_path / "elsewhere").exists()
    run.supervisor_lock_file.unlink()
    os.mkfifo(run.supervisor_lock_file)
    with pytest.raises(ConfigError, match="not a regular file"):
        acquire(run, "trainwatch run")


def test_a_child_of_the_holder_runs_under_it_and_others_do_not(run):
    lock = acquire(run, "trainwatch run")
    code = ("import sys; from trainwatch.rundir.run_dir import RunDir; "
            "from trainwatch.rundir.runlock import under_holder; "
            "print(under_holder(RunDir(sys.argv[1])) is not None)")
    try:
        mine = subprocess.run([sys.executable, "-c", code, str(run.root)],
                              capture_output=True, text=True, timeout=60)
        assert mine.stdout.strip() == "True", mine.stderr
        forged = subprocess.run(  # the token alone, outside the holder's tree, is not enough
            ["setsid", sys.executable, "-c", code, str(run.root)], capture_output=True,
            text=True, timeout=60, env={**os.environ, SUPERVISOR_ENV: "f" * 32})
        assert forged.stdout.strip() == "False", forged.stderr
        assert under_holder(run) is None  # the holder itself is not under itself
    finally:
        lock.release()


def test_a_spawned_child_outlives_the_thread_that_started_it(procs):
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: spawn forks from one thread
    that lives as long as the process, so a job restarted by a short-lived action thread
    is not killed when that thread returns."""
    box: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: box.append(spawn(SLEEP)))
    thread.start()
    thread.join()
    procs.extend(box)
    time.sleep(0.5)
    assert box[0].poll() is None
    plain: list[subprocess.Popen] = []  # what spawn guards against, for contrast
    from trainwatch.process.proctree import die_with_parent
    thread = threading.Thread(target=lambda: plain.append(
        subprocess.Popen(SLEEP, preexec_fn=die_with_parent())))
    thread.start()
    thread.join()
    procs.extend(plain)
    assert plain[0].wait(timeout=10) == -signal.SIGTERM


def test_every_command_that_starts_a_job_refuses_a_held_run_directory(run, tmp_path):
    """`trainwatch train` by hand, `alerts receive` with a job and `rehearse` respect the
    lock as `trainwatch run` does: exit 2 naming the holder, nothing started."""
    lock = acquire(run, "trainwatch run")
    env = {k: v for k, v in os.environ.items() if k != SUPERVISOR_ENV}
    env["TRAINWATCH_RECEIVER_TOKEN"] = "t" * 32
    commands = {
        "train": ["train", "--run-dir", str(run.root), "--nproc-per-node", "1",
                  "--set", "train.steps=1"],
        "receive": ["alerts", "receive", "--run-dir", str(run.root), "--listen", "127.0.0.1:0",
                    "--job-command", f"{sys.executable} -c pass"],
        "rehearse": ["rehearse", "--run-dir", str(run.root), "--nproc-per-node", "1"],
    }
    try:
        for name, args in commands.items():
            done = subprocess.run([sys.executable, "-m", "trainwatch", *args], env=env,
                                  capture_output=True, text=True, timeout=120)
            out = done.stdout + done.stderr
            assert done.returncode == 2, (name, out)
            assert f"already supervised by pid {os.getpid()} on host" in out, (name, out)
            assert "Traceback" not in out
        assert not run.events()  # none of them started or journaled anything
    finally:
        lock.release()


@pytest.mark.parametrize("command", [["run", "--no-live", "--run-dir", "{run}", "--", "true"],
                                     ["close", "{run}"]])
def test_a_full_disk_refuses_the_lock_with_exit_2_not_a_traceback(tmp_path, command):
    """The run directory's filesystem is full (the run filled it; the user runs the same
    command again): recording the holder fails, which was an OSError traceback, exit 1."""
    with tmpfs_mount(tmp_path / "disk", "1m") as disk:
        run = RunDir(disk / "run").create()
        fill_to_the_brim(disk)
        done = subprocess.run([sys.executable, "-m", "trainwatch",
                               *[part.format(run=run.root) for part in command]],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert (f"{run.supervisor_lock_file}: cannot record this holder in the lock file: No "
            "space left on device" in done.stderr)


def test_a_multi_node_job_has_one_supervisor_per_node_and_a_killed_ones_leftovers_go(
        run, procs):
    """The nodes of a multi-node job share the run directory: each node's supervisor holds
    its node's lock, a second one on the same node is refused (exit 2, naming the node),
    and a killed one's processes are stopped by the next supervisor of that node only."""
    other, other_child = _holder(run, procs, node="node-b")
    holder, child = _holder(run, procs, node="node-a")
    assert json.loads(run.node_supervisor_lock_file("node-a").read_text())["pid"] == holder.pid
    with pytest.raises(ConfigError, match=f"node node-a of this job is already supervised by "
                                          f"pid {holder.pid}.*one supervisor per node") as err:
        acquire(run, "trainwatch run", "node-a")
    assert err.value.exit_code == 2
    # A one-node supervisor's lock and the nodes' are different files.
    assert not run.supervisor_lock_file.exists()
    holder.kill()
    holder.wait()
    lock = hold(run, "trainwatch run", "node-a")
    try:
        assert lock.previous is not None and lock.previous.pid == holder.pid
        wait_for(lambda: _Pid(child).poll() is not None, 5, what="node-a's leftover to end")
        (event,) = run.events("leftovers_stopped")
        assert [p["pid"] for p in event["processes"]] == [child]
        # node-b's supervisor and its job are untouched.
        assert other.poll() is None and _Pid(other_child).poll() is None
    finally:
        lock.release()
    assert run.node_supervisor_lock_file("node-a").read_bytes() == b""
    assert run.node_supervisor_lock_file("a/../b").name == "a_.._b.lock"
