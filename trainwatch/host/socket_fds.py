"""Which sockets processes hold, looked up again cheaply: a process's fd table is listed
every time, but only fds not listed before are resolved (``readlink``), and the whole
table again every ``full_every`` seconds (a closed fd's number reused by a new socket).

A rank holds hundreds of fds (CUDA, data, logs) that rarely change; resolving all of them
for 64 ranks every few seconds would be most of the links collector's cost.
"""

from __future__ import annotations

import contextlib
import os
import time

FULL_EVERY = 30.0


def _socket_inode(target: str) -> int | None:
    return int(target[8:-1]) if target.startswith("socket:[") and target.endswith("]") else None


class SocketFds:
    def __init__(self, full_every: float = FULL_EVERY, proc_root: str = "/proc"):
        self.full_every = full_every
        self.proc_root = proc_root
        self._known: dict[int, tuple[float, dict[str, int | None]]] = {}  # pid -> (at, fds)

    def inodes(self, pid: int) -> set[int] | None:
        """The inodes of the sockets ``pid`` holds; None when its fds cannot be listed
        (another user's process, or gone): unseen, not "no connections"."""
        try:
            folder = os.open(os.path.join(self.proc_root, str(pid), "fd"),
                             os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            names = os.listdir(folder)
        except OSError:
            return None
        else:
            now = time.monotonic()
            at, known = self._known.get(pid, (now, {}))
            if now - at >= self.full_every:
                at, known = now, {}
            fds: dict[str, int | None] = {}
            for name in names:
                if name in known:
                    fds[name] = known[name]
                    continue
                with contextlib.suppress(OSError):
                    fds[name] = _socket_inode(os.readlink(name, dir_fd=folder))
            self._known[pid] = (at, fds)
            return {inode for inode in fds.values() if inode is not None}
        finally:
            os.close(folder)

    def forget_except(self, pids: set[int]) -> None:
        for pid in set(self._known) - pids:
            del self._known[pid]
