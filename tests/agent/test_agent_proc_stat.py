"""One read of /proc/<pid>/stat gives the facts psutil reads from three files."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

from trainwatch.host.proc_stat import read_proc_stat
from trainwatch.host.procinfo import _STATUS


def _kernel_state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][:1]


def _psutil_facts(pid: int) -> tuple[str, float, int, int]:
    proc = psutil.Process(pid)
    with proc.oneshot():
        times = proc.cpu_times()
        return (_STATUS.get(proc.status(), "unknown"), times.user + times.system,
                proc.num_threads(), proc.memory_info().rss)


def _wait_state(pid: int, letter: str) -> None:
    deadline = time.time() + 10
    while _kernel_state(pid) != letter and time.time() < deadline:
        time.sleep(0.01)
    assert _kernel_state(pid) == letter


def test_one_stat_read_gives_what_psutil_reads_sleeping_stopped_and_zombie():
    sleeper = subprocess.Popen(["sleep", "60"])
    zombie = subprocess.Popen(["true"])
    try:
        _wait_state(sleeper.pid, "S")
        _wait_state(zombie.pid, "Z")
        for pid, state in ((sleeper.pid, "sleeping"), (zombie.pid, "zombie")):
            read = read_proc_stat(pid)
            assert read is not None
            assert (read.state, read.cpu_seconds, read.threads, read.rss_bytes) \
                == _psutil_facts(pid)
            assert read.state == state
        os.kill(sleeper.pid, signal.SIGSTOP)
        _wait_state(sleeper.pid, "T")
        read = read_proc_stat(sleeper.pid)
        assert read is not None and read.state == "stopped" == _psutil_facts(sleeper.pid)[0]
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()


def test_this_process_with_threads_and_a_name_holding_parentheses(tmp_path):
    read = read_proc_stat(os.getpid())
    assert read is not None and read.threads == psutil.Process().num_threads()
    assert read.rss_bytes > 0
    named = tmp_path / "a (b) c"
    named.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(named), "60"])
    try:
        _wait_state(proc.pid, "S")
        read = read_proc_stat(proc.pid)
        assert read is not None
        assert (read.state, read.cpu_seconds, read.threads, read.rss_bytes) \
            == _psutil_facts(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_no_such_process_or_a_torn_file_is_left_to_psutil(tmp_path):
    assert read_proc_stat(2 ** 22 + 12345) is None
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (x) S 1 2")
    (tmp_path / "7" / "statm").write_text("730 443 415 5 0 89 0")
    assert read_proc_stat(7, str(tmp_path)) is None


def test_a_pid_given_to_another_process_reads_as_gone(tmp_path):
    """The rank's pid, reused by a process started later: the stat's start time tells."""
    from trainwatch.host.procinfo import ProcessTracker

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        _wait_state(sleeper.pid, "S")
        read = read_proc_stat(sleeper.pid)
        boot = psutil.boot_time()
        assert abs(boot + read.start_ticks / os.sysconf("SC_CLK_TCK")
                   - psutil.Process(sleeper.pid).create_time()) < 1.0
        tracker = ProcessTracker()
        assert tracker.inspect(sleeper.pid, started_at=None)["status"] == "sleeping"
        # the same pid, as the kernel would show it for a process started a second later
        fake = tmp_path / str(sleeper.pid)
        fake.mkdir()
        text = open(f"/proc/{sleeper.pid}/stat").read()
        head, tail = text.rsplit(") ", 1)
        fields = tail.split()
        fields[19] = str(int(fields[19]) + os.sysconf("SC_CLK_TCK"))
        (fake / "stat").write_text(head + ") " + " ".join(fields) + "\n")
        (fake / "statm").write_text(open(f"/proc/{sleeper.pid}/statm").read())
        tracker.proc_root = str(tmp_path)
        assert tracker.inspect(sleeper.pid, started_at=None)["status"] == "gone"
    finally:
        sleeper.kill()
        sleeper.wait()
