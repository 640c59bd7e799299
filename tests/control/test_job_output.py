"""The job's output goes through a pipe the supervisor drains: a full run-directory disk
costs lines of logs/job.log, never the job, and a killed supervisor leaves the job a pipe
that still takes its writes (no EPIPE), not a broken one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from agent_helpers import kill_pids, wait_for
from conftest import fill_to_the_brim, kill_tree, tmpfs_mount
from trainwatch.control.controller import JobController
from trainwatch.control.launch_log import LaunchLog

# 2000 lines of 100 bytes: far more than the full disk's last page could still take.
_PRINTS = ("import sys\n"
           "for i in range(2000):\n"
           "    print(f'line {i:05d} ' + 'x' * 89, flush=True)\n"
           "print('ValueError: the last words', file=sys.stderr, flush=True)\n")


def test_a_job_printing_onto_a_full_disk_runs_to_its_end_and_its_last_words_survive(tmp_path):
    """Before: its stdout was logs/job.log itself, and its first print on the full disk
    died of ENOSPC (or the supervisor's own line before it did)."""
    with tmpfs_mount(tmp_path / "run", "4m"):
        c = JobController(tmp_path / "run", [sys.executable, "-c", _PRINTS])
        launch = LaunchLog.from_now(c.run, c.output)
        fill_to_the_brim(c.run.root)
        try:
            c.start()
            code = c.proc.wait(timeout=60)
        finally:
            c.close("test teardown")
    assert code == 0
    assert c.output.dropped_bytes >= 2000 * 100, c.output.dropped_bytes
    assert c.output.log.error == "No space left on device"
    assert launch.first_error() == "ValueError: the last words"  # from the tail in memory
    assert "line 01999" in launch.last_lines(n=2)


_SUPERVISOR = """
import sys, time
from trainwatch.control.controller import JobController
c = JobController(sys.argv[1], [sys.executable, "-c", sys.argv[2]])
c.start()
time.sleep(600)
"""

# Ignores SIGTERM, waits for its supervisor to be gone, then prints 200 KB (more than a
# default pipe holds) and says whether every write went through.
_STUBBORN_JOB = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    ready, done = os.environ["READY"], os.environ["DONE"]
    open(ready, "w").write(str(os.getpid()))
    while os.getppid() == parent:
        time.sleep(0.05)
    try:
        for i in range(2000):
            print(f"line {i:05d} " + "x" * 89, flush=True)
        outcome = "ok"
    except BaseException as exc:
        outcome = repr(exc)
    open(done, "w").write(outcome)
""")


def test_a_job_that_ignores_sigterm_meets_no_broken_pipe_when_its_supervisor_is_killed(
        tmp_path):
    """The job keeps its pipe's read end: with the supervisor SIGKILLed its writes fill the
    pipe's buffer (1 MiB) instead of failing, so a job busy saving is not cut short."""
    ready, done = tmp_path / "ready", tmp_path / "done"
    env = {**os.environ, "READY": str(ready), "DONE": str(done)}
    sup = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, str(tmp_path / "run"),
                            _STUBBORN_JOB], env=env)
    job_pid = None
    try:
        wait_for(lambda: ready.exists() and ready.read_text(), 60, what="the job")
        job_pid = int(ready.read_text())
        sup.send_signal(signal.SIGKILL)
        sup.wait(timeout=10)
        outcome = wait_for(lambda: done.exists() and done.read_text(), 60, what="its prints")
    finally:
        kill_tree(sup)
        if job_pid is not None:
            kill_pids([job_pid])
    assert outcome == "ok"
