"""One supervisor per run directory (per node of a multi-node job), and nothing left
behind by a killed one.

A supervisor (``trainwatch run``, ``alerts receive`` with a job, ``trainwatch train``
started by hand, ``rehearse``) holds an exclusive ``flock`` on ``RUN_DIR/supervisor.lock``
for its whole life and writes who it is into the file. A second one is refused at once
(exit 2, naming the holder's pid and host). The nodes of a multi-node job share one run
directory: each node's supervisor holds ``RUN_DIR/supervisors/<node>.lock`` instead, so a
second supervisor on the same node is refused and the other nodes' are not. The kernel
drops the lock when its holder dies, however it dies, so a lock is never stale; the
record it leaves says who held it, and the next holder stops what that one left running
(its children carry its ``token`` in their environment) before it starts anything.
docs/architecture.md has the NFS caveats.

The file is never replaced or removed (a lock on a replaced inode guards nothing), and a
holder never opens it a second time: over NFS, flock is a POSIX lock, which closing *any*
descriptor of the file in the holder's process would drop.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from trainwatch.contract.env import SUPERVISOR_ENV
from trainwatch.contract.layout import FORMAT_VERSION, LOCK_FORMAT
from trainwatch.errors import ConfigError
from trainwatch.process.proctree import marked, terminate
from trainwatch.rundir.beat import read_beat
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import SkippedFile, read_run_file

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 4096
RECORD_WAIT_SECONDS = 2.0   # a holder that has just locked writes its record within this
LEFTOVER_GRACE_SECONDS = 15.0  # a leftover job's ranks may checkpoint, as on any stop


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run's lock: enough to tell that process from a reused pid."""

    pid: int
    host: str
    started_at: float   # the process's start time (psutil create_time)
    token: str          # what its children carry in SUPERVISOR_ENV
    role: str           # the command, e.g. "trainwatch run"
    since: float        # when it took the lock

    @classmethod
    def me(cls, role: str) -> "Holder":
        return cls(pid=os.getpid(), host=socket.gethostname(),
                   started_at=psutil.Process().create_time(), token=uuid.uuid4().hex,
                   role=role, since=time.time())

    @classmethod
    def parse(cls, data: bytes) -> "Holder | None":
        try:
            obj = json.loads(data)
            if obj.get("format") != LOCK_FORMAT:
                return None
            return cls(pid=int(obj["pid"]), host=str(obj["host"]),
                       started_at=float(obj["started_at"]), token=str(obj["token"]),
                       role=str(obj["role"]), since=float(obj["since"]))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None

    def to_json(self) -> dict[str, Any]:
        return {"format": LOCK_FORMAT, "version": FORMAT_VERSION, **asdict(self)}

    def here(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """This very process still runs on this host (not a process that got its pid)."""
        if not self.here():
            return False
        try:
            return abs(psutil.Process(self.pid).create_time() - self.started_at) < 0.01
        except psutil.Error:
            return False

    def describe(self) -> str:
        return (f"pid {self.pid} on host {self.host} ({self.role}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))})")


class RunLock:
    """A held lock; ``release()`` (or the holder's death) frees it."""

    def __init__(self, fd: int, holder: Holder, previous: Holder | None):
        self.fd, self.holder, self.previous = fd, holder, previous
        self._saved_env = os.environ.get(SUPERVISOR_ENV)
        os.environ[SUPERVISOR_ENV] = holder.token  # every child we start inherits it

    def release(self) -> None:
        """Clear the record (a clean end leaves nothing to check) and unlock."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1
        if self._saved_env is None:
            os.environ.pop(SUPERVISOR_ENV, None)
        else:
            os.environ[SUPERVISOR_ENV] = self._saved_env


def lock_path(run: RunDir, node: str | None = None) -> Any:
    """The run's one lock, or with ``node`` (a multi-node job: one supervisor per node on
    the shared run directory) that node's."""
    return run.supervisor_lock_file if node is None else run.node_supervisor_lock_file(node)


def acquire(run: RunDir, role: str, node: str | None = None) -> RunLock:
    """Take the run's lock for ``role`` (``node``: that node's lock of a multi-node job) or
    raise ConfigError (exit 2) naming its holder."""
    run.create()
    path = lock_path(run, node)
    if node is not None:
        path.parent.mkdir(exist_ok=True)
    for _ in range(3):
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _wait_for_record(fd) if exc.errno in (errno.EAGAIN, errno.EACCES) else None
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"cannot lock: {exc.strerror}", file=str(path)) from None
            raise _refusal(run, holder, node=node) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # replaced or removed between our open and our lock: lock the new one
    else:
        raise ConfigError("keeps being replaced while we lock it", file=str(path))
    previous = Holder.parse(os.pread(fd, MAX_RECORD_BYTES, 0))
    if previous is not None and previous.alive():
        # It runs but does not hold the lock: the file was removed and made again, or an
        # NFS lease was lost. Two supervisors would follow; refuse.
        os.close(fd)
        raise _refusal(run, previous, lost=True, node=node)
    me = Holder.me(role)
    data = json.dumps(me.to_json()).encode() + b"\n"
    try:
        os.ftruncate(fd, 0)
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.fsync(fd)  # NFS: another client reads what the server has
    except OSError as exc:  # a full disk: a lock whose holder nobody could name is no lock
        os.close(fd)
        raise ConfigError(f"cannot record this holder in the lock file: {exc.strerror} "
                          "(free space in the run directory, then run the command again)",
                          file=str(path)) from None
    return RunLock(fd, me, previous)


def under_holder(run: RunDir) -> Holder | None:
    """The live holder this process runs under (an ancestor whose token we inherited), if
    any: the launcher a supervisor starts holds no lock of its own."""
    token = os.environ.get(SUPERVISOR_ENV)
    if not token:
        return None
    try:
        with open(run.supervisor_lock_file, "rb") as fh:
            holder = Holder.parse(fh.read(MAX_RECORD_BYTES))
    except OSError:
        return None
    if holder is None or holder.token != token or not holder.alive():
        return None
    ancestors = {p.pid for p in psutil.Process().parents()}
    return holder if holder.pid in ancestors else None


def recorded_holder(run: RunDir, node: str | None = None) -> Holder | None:
    """The holder the lock file names (``node``: that node's of a multi-node job), without
    taking the lock (a reader must never make a supervisor starting that instant refuse):
    None when it names none (a clean end clears it). Whether that holder still runs is
    ``Holder.alive`` (this host only)."""
    try:
        return Holder.parse(read_run_file(lock_path(run, node), run.root,
                                          max_bytes=MAX_RECORD_BYTES))
    except (OSError, SkippedFile):
        return None


def hold(run: RunDir, role: str, node: str | None = None) -> RunLock:
    """What every command that starts a job calls before it starts one: the lock
    (ConfigError if another holds it), with whatever a killed previous holder left running
    stopped first. ``node``: a multi-node job's supervisor on that node, which holds that
    node's lock; it stops what a killed supervisor of the same node left."""
    lock = acquire(run, role, node)
    try:
        if lock.previous is not None:
            journal_died(run, lock.previous, node)
        stop_leftovers(run, lock)
    except BaseException:
        lock.release()
        raise
    return lock


def journal_died(run: RunDir, previous: Holder, node: str | None) -> None:
    """The previous holder died without releasing the lock (SIGKILL, a crash, an OOM
    kill): say so, with its last heartbeat when it wrote one, so the run's story (report,
    diagnose) does not read its job's end as a stop on request."""
    beat = read_beat(run.supervisor_beat_file if node is None
                     else run.node_supervisor_beat_file(node), run.root)
    at = beat.get("at") if beat is not None and beat.get("token") == previous.token else None
    try:
        run.append_event("supervisor_died", "supervisor", previous=previous.to_json(),
                         node=node,
                         last_beat_at=at if isinstance(at, (int, float)) else None)
    except OSError as exc:  # a full disk costs the record, never the start
        log.warning("could not journal the previous supervisor's death: %s", exc)


def stop_leftovers(run: RunDir, lock: RunLock,
                   grace: float = LEFTOVER_GRACE_SECONDS) -> list[dict[str, Any]]:
    """Stop what the previous holder left running (it died without releasing the lock):
    the processes that carry its token, found on this host. Journals what it stopped;
    ConfigError if any cannot be stopped (two jobs would train)."""
    previous = lock.previous
    if previous is None:
        return []
    if not previous.here():
        run.append_event("leftovers_unchecked", "supervisor", previous=previous.to_json(),
                         reason=f"the previous supervisor ran on host {previous.host}; its "
                                "processes there cannot be seen from here")
        log.warning("the previous supervisor of %s (%s) did not release it; processes it "
                    "left on %s cannot be checked from here", run.root, previous.describe(),
                    previous.host)
        return []
    procs = marked(SUPERVISOR_ENV, previous.token)
    if not procs:
        return []
    found = [_describe(p) for p in procs]
    log.warning("stopping %d process(es) that the killed supervisor %s left running",
                len(found), previous.describe())
    left = terminate(procs, grace)
    run.append_event("leftovers_stopped", "supervisor", previous=previous.to_json(),
                     processes=found, left=[p.pid for p in left])
    if left:
        raise ConfigError(f"processes the previous supervisor ({previous.describe()}) left "
                          f"running could not be stopped: pids {[p.pid for p in left]}; "
                          "stop them, then start again", file=str(run.root))
    return found


def _open(path: Any) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot open the lock file: {exc.strerror}", file=str(path)) from None
    if not _regular(fd):
        os.close(fd)
        raise ConfigError("the lock file is not a regular file", file=str(path))
    return fd


def _regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)


def _same_file(fd: int, path: Any) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _wait_for_record(fd: int) -> Holder | None:
    """The holder's record; a holder that has just taken the lock writes it at once."""
    deadline = time.monotonic() + RECORD_WAIT_SECONDS
    while True:
        holder = Holder.parse(os.pread(fd, MAX_RECORD_BYTES, 0))
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.05)


def _refusal(run: RunDir, holder: Holder | None, lost: bool = False,
             node: str | None = None) -> ConfigError:
    who = holder.describe() if holder is not None else (
        "a process that has not written its record yet")
    if lost:
        why = (f"its supervisor {who} still runs although it no longer holds "
               f"{lock_path(run, node).name} (the file was removed, or an NFS lock was "
               "lost)")
    else:
        why = f"already supervised by {who}"
    if node is not None:
        return ConfigError(f"node {node} of this job is {why}: one supervisor per node; stop "
                           "it first, or give this node another --node-name",
                           file=str(run.root))
    return ConfigError(f"{why}: one supervisor per run directory; stop it first, or use "
                       "another run directory", file=str(run.root))


def _describe(proc: psutil.Process) -> dict[str, Any]:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        cmd = ""
    return {"pid": proc.pid, "command": cmd[:200]}
