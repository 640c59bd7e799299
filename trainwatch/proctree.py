"""Stopping processes we started, and waiting for a killed tree to be gone."""

from __future__ import annotations

import signal
import subprocess
import time

import psutil


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Send ``sig``; SIGKILL the process if it has not exited after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has exited; return those still running at ``timeout``.

    A killed process whose parent was killed too is a zombie until pid 1 reaps it, and
    in a container pid 1 may never do so: a zombie counts as gone (it runs no code and
    holds no port or GPU memory), or every restart would wait out the whole timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
