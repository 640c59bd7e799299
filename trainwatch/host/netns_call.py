"""Run a function or a command in the network namespace of another process (its
``/proc/PID/ns/net``): its sockets, interfaces and queues are only visible from there.

The same namespace as ours: run here, no privilege needed. Another one (a container, a
network namespace per node): entering it needs CAP_SYS_ADMIN (root); a function runs in
a thread of its own that enters it (a namespace is per thread), a command under
``nsenter --net``. Not allowed: ``PermissionError``, which callers report as unseen.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

CLONE_NEWNET = 0x40000000


def netns_id(pid: int | str = "self") -> str | None:
    """The namespace's identity (``net:[4026531840]``), None when it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _enter(pid: int) -> None:
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise PermissionError(errno, f"cannot enter the network namespace of pid {pid}: "
                                         f"{os.strerror(errno)}")
    finally:
        os.close(fd)


def call_in_netns(pid: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` in the network namespace of ``pid``."""
    if netns_id(pid) == netns_id():
        return fn()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(_enter, pid).result()  # the pool's one thread is now in there
        return pool.submit(fn).result()


def command_in_netns(pid: int, argv: list[str], timeout: float = 5.0) -> str:
    """The output of ``argv`` run in the network namespace of ``pid``; OSError (a
    PermissionError when it cannot enter) or a failed command raise."""
    if netns_id(pid) != netns_id():
        argv = ["nsenter", f"--net=/proc/{pid}/ns/net", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        error = done.stderr.strip()
        kind = PermissionError if "Operation not permitted" in error else OSError
        raise kind(f"{' '.join(argv)}: {error or f'exit {done.returncode}'}")
    return done.stdout
