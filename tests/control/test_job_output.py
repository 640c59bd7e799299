"""The job's output goes through a pipe the supervisor drains: a full run-directory disk
costs lines of logs/job.log, never the job, nor does a disk that hangs (the log is written
behind a bounded queue); the job's last words survive in memory, in the journal and, once
there is room, in the log; a killed supervisor leaves the job a pipe that still takes its
writes (no EPIPE), not a broken one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from agent_helpers import kill_pids, wait_for
from conftest import fill_to_the_brim, frozen_disk, kill_tree, tmpfs_mount
from trainwatch.control.controller import JobController
from trainwatch.control.launch_log import LaunchLog
from trainwatch.contract.layout import JOB_LOG

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


def test_a_job_that_dies_while_its_log_is_full_leaves_its_last_words_in_journal_and_log(
        tmp_path):
    """Before: its traceback went to the full disk and was lost (the journal said only
    "exited 1"); now job_exited carries the last lines from memory, and the log gets the
    end of what it missed, under the gap line, once space returns."""
    run = tmp_path / "run"
    with tmpfs_mount(run / "logs", "1m"):
        c = JobController(run, [sys.executable, "-c", _PRINTS + "raise SystemExit(1)\n"])
        fill_to_the_brim(run / "logs")
        try:
            c.start()
            code = c.proc.wait(timeout=60)
            c.journal_exit(c.proc.pid, code)
            (run / "logs" / "filler").unlink()
            assert c.output.drain()  # the log takes the gap's line now, not at a next start
            log = (run / "logs" / JOB_LOG).read_text()
        finally:
            c.close("test teardown")
    exited = c.run.events("job_exited")[-1]
    assert exited["returncode"] == 1 and exited["output_dropped_bytes"] >= 2000 * 100
    assert exited["last_words"].endswith("line 01999 " + "x" * 89
                                         + "\nValueError: the last words"), exited
    gap = log.index("bytes of output are missing here")
    assert log.rstrip().endswith("ValueError: the last words"), log[gap:][:500]


# Prints 12 MiB (more than the pipe and the log's queue hold), then its last words, then
# says it is done in DONE: a job must never wait for its log's disk.
_LOUD_JOB = ("import os, sys\n"
             "for i in range(120000):\n"
             "    print(f'line {i:06d} ' + 'x' * 88, flush=i % 1000 == 0)\n"
             "print('RuntimeError: the last words', flush=True)\n"
             "open(os.environ['DONE'], 'w').write('done')\n")

# A supervisor of that job; once the job exited, what it saw goes to RESULT.
_LOUD_SUPERVISOR = """
import json, os, sys, time
from trainwatch.control.controller import JobController
c = JobController(sys.argv[1], [sys.executable, "-c", sys.argv[2]])
c.start()
code = c.proc.wait()
c.output.drain(5)  # as journal_exit does: the pipe's last bytes reach the tail first
with open(os.environ["RESULT"], "w") as fh:
    json.dump({"code": code, "dropped": c.output.dropped_bytes, "error": c.output.error,
               "last_words": c.last_words()}, fh)
time.sleep(600)
"""


def test_a_job_whose_log_disk_hangs_runs_to_its_end(tmp_path):
    """logs/ on a frozen disk: every write to it hangs in the kernel. Before: the pump
    hung in the log's write, the pipe filled and the job's next print waited for ever.
    Now the job prints its 12 MiB and ends; what the log's queue could not hold is
    counted, and its last words are in memory."""
    run, done, result = tmp_path / "run", tmp_path / "done", tmp_path / "result"
    env = {**os.environ, "DONE": str(done), "RESULT": str(result)}
    sup = None
    try:
        with frozen_disk(run / "logs", tmp_path / "logs.img"):
            sup = subprocess.Popen([sys.executable, "-c", _LOUD_SUPERVISOR, str(run),
                                    _LOUD_JOB], env=env)
            wait_for(lambda: done.exists() or sup.poll() is not None, 60,
                     what="the job's end while its log's disk hangs")
            seen = json.loads(wait_for(lambda: result.exists() and result.read_text(), 30,
                                       what="the supervisor's view"))
    finally:
        if sup is not None:
            kill_tree(sup)
    assert seen["code"] == 0
    assert seen["dropped"] >= 2 << 20, seen
    assert "fell 8 MiB behind" in seen["error"], seen
    assert seen["last_words"].endswith("RuntimeError: the last words"), seen


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
