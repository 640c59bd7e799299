"""A rank's process as this host sees it, when the rank runs in a PID namespace of its own.

A trainer pod without ``hostPID`` (the privilege admins refuse) runs its ranks in the pod's
own PID namespace: the pid a rank publishes is its pid there, and on the host that number
is another process or none. So a rank also publishes its namespace (``pid_namespace``: the
inode of ``/proc/self/ns/pid``), and the agent, which sees the host's processes (its
DaemonSet has ``hostPID``), finds the host process in that namespace whose innermost pid
(the last of ``NSpid:`` in ``/proc/PID/status``) is the published one. The process's start
time (``process_created_at``) then tells it from a later one, as for any pid
(``procinfo.reused``). Reading another user's ``/proc/PID/ns/pid`` takes ptrace access
(``SYS_PTRACE``): without it the answer is "unknown", never a guess.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

# A rank looked for and not found (gone, or not readable) is looked for again after this:
# a namespace's processes are all listed once per look, so not every second.
RESCAN_SECONDS = 5.0


def own_pid_namespace(proc_root: str = "/proc") -> int | None:
    """The inode of the calling process's PID namespace (what a rank publishes)."""
    try:
        return os.stat(f"{proc_root}/self/ns/pid").st_ino
    except OSError:
        return None


def _namespace_of(proc_root: str, pid: str) -> int | None:
    return os.stat(f"{proc_root}/{pid}/ns/pid").st_ino


def ns_pids(proc_root: str, pid: int | str) -> list[int]:
    """The process's pids from the outermost PID namespace ``proc_root`` shows to its own
    (``NSpid:``; world-readable, unlike the namespace link); [] if unknown."""
    try:
        with open(f"{proc_root}/{pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return [int(n) for n in line.split()[1:]]
    except (OSError, ValueError):
        return []
    return []


def _number(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


class HostPids:
    """Maps (namespace, pid in it, start time) to the host's pid, once per process.

    ``begin()`` before a collection's lookups, ``end()`` after: what was not asked for
    is forgotten. A mapping found stays (whether that host pid still runs the rank is
    the process inspection's to say, by its start time); one not found is looked for
    again after ``RESCAN_SECONDS``.
    """

    def __init__(self, proc_root: str = "/proc"):
        self.proc_root = proc_root
        self.own = own_pid_namespace(proc_root) or own_pid_namespace()
        self._found: dict[tuple[int, int, Any], int] = {}
        self._missing: dict[tuple[int, int, Any], tuple[float, str]] = {}  # -> (when, why)
        self._asked: set[tuple[int, int, Any]] = set()
        self._warned = False

    def begin(self) -> None:
        self._asked = set()

    def end(self) -> None:
        for table in (self._found, self._missing):
            for key in set(table) - self._asked:
                del table[key]

    def host_pid(self, pid: Any, namespace: Any, created_at: Any = None
                 ) -> tuple[int | None, str | None]:
        """(the host's pid, None), or (None, why: ``gone`` or ``unknown``). A status of an
        older writer (no namespace) or of this namespace: its pid as published."""
        pid, namespace = _number(pid), _number(namespace)
        if pid is None:
            return None, "unknown"
        if namespace is None or namespace == self.own:
            return pid, None
        key = (namespace, pid, created_at)
        self._asked.add(key)
        if key in self._found:
            return self._found[key], None
        missing = self._missing.get(key)
        if missing is not None and time.monotonic() - missing[0] < RESCAN_SECONDS:
            return None, missing[1]
        self._scan({k for k in self._asked if k not in self._found})
        if key in self._found:
            return self._found[key], None
        return None, self._missing[key][1]

    def _scan(self, wanted: set[tuple[int, int, Any]]) -> None:
        """One pass over the host's processes for every key still wanted."""
        namespaces = {k[0] for k in wanted}
        unsure: set[int] = set()  # pids that a process we may not look at could be
        try:
            entries = [e.name for e in os.scandir(self.proc_root) if e.name.isdigit()]
        except OSError:
            entries, unsure = [], {k[1] for k in wanted}
        for name in entries:
            try:
                ns = _namespace_of(self.proc_root, name)
            except PermissionError:
                # Not ours to look at (no SYS_PTRACE, or not dumpable). It may be the rank
                # only if it runs in a namespace below this one with a pid wanted there.
                pids = ns_pids(self.proc_root, name)
                if len(pids) != 1:
                    unsure.add(pids[-1] if pids else 0)
                continue
            except OSError:  # exited meanwhile, or a zombie (its namespaces are gone)
                continue
            if ns not in namespaces:
                continue
            inner = (ns_pids(self.proc_root, name) or [0])[-1]
            for key in wanted:
                if key[0] == ns and key[1] == inner:
                    self._found[key] = int(name)
                    self._missing.pop(key, None)
        now = time.monotonic()
        for key in wanted - set(self._found):
            unknown = key[1] in unsure or 0 in unsure
            self._missing[key] = (now, "unknown" if unknown else "gone")
            if unknown and not self._warned:
                self._warned = True
                log.warning("cannot read other processes' PID namespaces under %s: a rank in a "
                            "PID namespace of its own is 'unknown' (give the agent SYS_PTRACE "
                            "and hostPID; docs/deploy.md)", self.proc_root)
