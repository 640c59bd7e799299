"""Starting children that die with us, stopping processes we started, and waiting for a
killed tree to be gone."""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import psutil

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once, here: the child of a fork in a threaded process must not load libraries.
_PRCTL = _load_prctl()


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn``: the child gets ``sig`` when the *thread* that forked it ends
    (PR_SET_PDEATHSIG; also when the whole process is SIGKILLed). None where Linux's prctl
    is missing. A parent that died before the prctl is noticed (the child then has another
    parent) and the child signals itself."""
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
    return preexec


class _Spawner:
    """Forks from one thread that lives as long as the process. PR_SET_PDEATHSIG fires when
    the forking *thread* ends: a job restarted from a short-lived action thread would get
    its signal the moment that thread returned, so no child is forked there."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:  # a daemon thread never ends before the process does
                self._thread = threading.Thread(target=self._serve, name="tw-spawner",
                                                daemon=True)
                self._thread.start()
        result: Future = Future()
        self._requests.put((result, args, kwargs))
        return result.result()

    def _serve(self) -> None:
        while True:
            result, args, kwargs = self._requests.get()
            try:
                result.set_result(subprocess.Popen(args, preexec_fn=die_with_parent(),
                                                   **kwargs))
            except BaseException as exc:  # handed to the caller
                result.set_exception(exc)


_SPAWNER = _Spawner()


def spawn(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)`` for a child that must not outlive this process:
    it gets SIGTERM when we die, however we die (Linux; elsewhere a plain Popen, and the
    next supervisor's leftover check is the only guard)."""
    if _PRCTL is None:
        return subprocess.Popen(args, **kwargs)
    return _SPAWNER.popen(args, **kwargs)


def marked(name: str, value: str) -> list[psutil.Process]:
    """Running processes whose environment holds ``name=value``: what one supervisor started
    (an environment is inherited, and a reused pid does not carry it). Only environments we
    may read are looked at (our own user's; any as root); never this process or its
    ancestors."""
    skip = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        try:
            if proc.environ().get(name) == value and _running(proc):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def terminate(procs: list[psutil.Process], grace: float) -> list[psutil.Process]:
    """SIGTERM (after SIGCONT: a stopped process must run to stop) to every process, SIGKILL
    to those still running after ``grace`` seconds; returns those left even then. psutil
    checks each pid is still the process it listed before signalling it."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for proc in procs:
            _signal(proc, sig)
    left = wait_gone(procs, grace)
    for proc in left:
        _signal(proc, signal.SIGKILL)
    return wait_gone(left, 5)


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


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
