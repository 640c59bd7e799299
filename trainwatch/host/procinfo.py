"""Facts about a rank's OS process (psutil) and the CPU load on its cores (/proc/stat).

A status file names the rank's pid; the pid is trusted only if that process was
created before the rank's telemetry started (a reused pid is a different process).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainwatch.host import unix_peer
from trainwatch.host.proc_stat import read_proc_stat, read_small

# psutil status -> the names trainwatch uses (docs/agent.md)
_STATUS = {
    psutil.STATUS_RUNNING: "running", psutil.STATUS_SLEEPING: "sleeping",
    psutil.STATUS_IDLE: "sleeping", psutil.STATUS_DISK_SLEEP: "disk_sleep",
    psutil.STATUS_STOPPED: "stopped", psutil.STATUS_TRACING_STOP: "stopped",
    psutil.STATUS_ZOMBIE: "zombie", psutil.STATUS_DEAD: "gone",
}
# Filtered environment the NCCL and network collectors need; values never leave the agent.
# The shortest window a CPU rate is taken over (CPU times count in 10 ms ticks).
CPU_RATE_MIN_SECONDS = 0.5
ENV_PREFIXES = ("NCCL_", "TORCH_", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")


def read_cpu_jiffies(proc_root: str) -> dict[int, tuple[float, float]]:
    """Per-CPU (busy, total) seconds from /proc/stat."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, tuple[float, float]] = {}
    try:
        lines = Path(proc_root, "stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        parts = line.split()
        try:
            cpu = int(parts[0][3:])
            values = [int(v) for v in parts[1:]]
        except ValueError:
            continue
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        total = sum(values[:8])  # guest time is already in user/nice
        out[cpu] = ((total - idle) / ticks, total / ticks)
    return out


@dataclass
class _Tracked:
    process: psutil.Process
    env: dict[str, str] = field(default_factory=dict)
    facts: dict[str, Any] | None = None  # the last inspection's
    due: float = 0.0                     # monotonic: inspect again from then on
    # (monotonic, CPU seconds, main thread runnable ns) the rates below are from
    cpu_at: tuple[float, float, int | None] | None = None
    cpu_rates: tuple[float | None, float | None] = (None, None)  # see _cpu_rates
    start_ticks: int | None = None  # /proc/<pid>/stat's start time at the first read


class ProcessTracker:
    """Keeps psutil handles per pid so CPU deltas and env reads are cheap across runs."""

    def __init__(self, proc_root: str = "/proc"):
        self.proc_root = proc_root
        self._tracked: dict[int, _Tracked] = {}
        self._cpu_now: dict[int, tuple[float, float]] = {}
        # pid -> (its CPU seconds, the per-CPU load) at its last inspection
        self._own_prev: dict[int, tuple[float, dict[int, tuple[float, float]]]] = {}

    def begin(self) -> None:
        """Call once per collection before ``inspect``: samples per-CPU load."""
        self._cpu_now = read_cpu_jiffies(self.proc_root)

    def end(self, live_pids: set[int]) -> None:
        for pid in list(self._tracked):
            if pid not in live_pids:
                del self._tracked[pid]
                self._own_prev.pop(pid, None)

    def inspect(self, pid: Any, started_at: Any, reuse_for: float = 0.0,
                created_at: Any = None) -> dict[str, Any]:
        """Process facts for one rank; ``status`` is ``gone`` or ``unknown`` when not found.

        Is ``pid`` still the rank's process? ``created_at`` (the start time the rank read of
        itself from the kernel) must match the process's; without it (older writers),
        the process must not be younger than the rank's ``started_at``, which trusts the
        rank's wall clock to agree with this host's.

        ``reuse_for``: the facts of an inspection up to that many seconds old are returned
        as they were (the first wait is staggered by pid, so many ranks are not all
        inspected in the same collection); 0 inspects now.
        """
        if not isinstance(pid, int) or pid <= 0:
            return {"status": "unknown"}
        tracked = self._tracked.get(pid)
        mono = time.monotonic()
        if tracked is not None and tracked.facts is not None and reuse_for > 0 \
                and mono < tracked.due:
            return tracked.facts
        try:
            if tracked is None:
                proc = psutil.Process(pid)
                if reused(proc.create_time(), started_at, created_at):
                    return {"status": "gone"}
                tracked = self._tracked[pid] = _Tracked(proc, env=_filtered_env(proc))
                tracked.due = mono + reuse_for * (pid % 5 + 1) / 5
            else:
                tracked.due = mono + reuse_for
            proc = tracked.process
            read = read_proc_stat(pid, self.proc_root)
            if read is not None and tracked.start_ticks is None:
                tracked.start_ticks = read.start_ticks
            elif read is not None and read.start_ticks != tracked.start_ticks:
                # the rank is gone and its pid was given to another process since
                del self._tracked[pid]
                self._own_prev.pop(pid, None)
                return {"status": "gone"}
            if read is not None:  # one read for what psutil takes three files for
                cpu = read.cpu_seconds
                info: dict[str, Any] = {"status": read.state, "cpu_seconds": cpu,
                                        "rss_bytes": read.rss_bytes, "threads": read.threads}
                cpus = _affinity(proc)
            else:  # psutil tells a gone process from a zombie or a denied one
                with proc.oneshot():
                    status = _STATUS.get(proc.status(), "unknown")
                    times = proc.cpu_times()
                    cpu = times.user + times.system
                    info = {"status": status, "cpu_seconds": cpu,
                            "rss_bytes": proc.memory_info().rss,
                            "threads": proc.num_threads()}
                    cpus = _affinity(proc)
            info["cpus"] = cpus
            info["cpu_contention_ratio"] = self._contention(pid, cpu, cpus)
            info["cpu_cores"], info["main_runnable"] = _cpu_rates(tracked, mono, cpu,
                                                                  self.proc_root)
            tracked.facts = info
            return info
        except psutil.NoSuchProcess:
            self._tracked.pop(pid, None)
            return {"status": "gone"}
        except psutil.ZombieProcess:
            return self._remember(tracked, {"status": "zombie"})
        except psutil.AccessDenied:
            return self._remember(tracked, {"status": "unknown"})

    @staticmethod
    def _remember(tracked: _Tracked | None, facts: dict[str, Any]) -> dict[str, Any]:
        if tracked is not None:
            tracked.facts = facts
        return facts

    def env(self, pid: Any) -> dict[str, str]:
        tracked = self._tracked.get(pid) if isinstance(pid, int) else None
        return dict(tracked.env) if tracked else {}

    def _contention(self, pid: int, cpu_seconds: float, cpus: list[int]) -> float | None:
        """Share of the rank's allowed cores' time used by *other* processes since its
        last inspection."""
        prev = self._own_prev.get(pid)
        self._own_prev[pid] = (cpu_seconds, self._cpu_now)
        if prev is None or not cpus or not prev[1]:
            return None
        before = prev[1]
        busy = total = 0.0
        for cpu in cpus:
            if cpu in self._cpu_now and cpu in before:
                busy += self._cpu_now[cpu][0] - before[cpu][0]
                total += self._cpu_now[cpu][1] - before[cpu][1]
        if total <= 0:
            return None
        others = busy - (cpu_seconds - prev[0])
        return min(1.0, max(0.0, others / total))


def _affinity(proc: psutil.Process) -> list[int]:
    """The cores the process may run on; none where that cannot be read."""
    try:
        return proc.cpu_affinity()
    except (psutil.Error, AttributeError, OSError):
        return []


def _cpu_rates(tracked: _Tracked, mono: float, cpu: float,
               proc_root: str) -> tuple[float | None, float | None]:
    """(cores the process used, share of the time its main thread ran or waited to run)
    since an inspection at least ``CPU_RATE_MIN_SECONDS`` ago; None at the first. A rank
    that burns CPU with a silent heartbeat is busy, not frozen (agent/stall.py); on a
    loaded machine its main thread waits to run more than it runs."""
    before = tracked.cpu_at
    if before is not None and mono - before[0] < CPU_RATE_MIN_SECONDS:
        return tracked.cpu_rates  # too short a window for clock-tick CPU times
    pid = tracked.process.pid
    runnable = main_thread_runnable_ns(pid, proc_root)
    tracked.cpu_at = (mono, cpu, runnable)
    if before is not None:
        elapsed = mono - before[0]
        main = None if runnable is None or before[2] is None else \
            min(1.0, max(0, runnable - before[2]) / 1e9 / elapsed)
        tracked.cpu_rates = (max(0.0, cpu - before[1]) / elapsed, main)
    return tracked.cpu_rates


def main_thread_runnable_ns(pid: int, proc_root: str = "/proc") -> int | None:
    """Nanoseconds a process's main thread ran plus waited to run (``schedstat``), None if
    unknown: on a loaded machine a spinning thread waits to run more than it runs, so its
    CPU time alone would not show it busy."""
    fields = (read_small(f"{proc_root}/{pid}/task/{pid}/schedstat") or b"").split()
    try:
        return int(fields[0]) + int(fields[1])
    except (ValueError, IndexError):
        return None


def _filtered_env(proc: psutil.Process) -> dict[str, str]:
    try:
        env = proc.environ()
    except (psutil.Error, OSError):
        return {}
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIXES)}


# --------------------------------------------------------------------------- thread waits
# What a blocked thread waits for, as the kernel tells it: the thread's state and wait
# channel, its current system call and arguments (/proc/PID/task/TID/syscall), and what
# the call's fd or address points at (a file lock and its holder, a FIFO, a pipe or socket
# and who holds the other end, a file and its mount).  Python frames cannot say this when
# the code is blocked inside a builtin (lock.acquire, fcntl.flock, open).

# x86-64 and aarch64 numbers of the calls a blocked thread is typically in.
_SYSCALLS = {
    "x86_64": {0: "read", 1: "write", 2: "open", 7: "poll", 19: "readv", 20: "writev",
               23: "select", 35: "nanosleep", 42: "connect", 43: "accept", 44: "sendto",
               45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 61: "wait4", 72: "fcntl",
               73: "flock", 74: "fsync", 202: "futex", 230: "clock_nanosleep",
               232: "epoll_wait", 257: "openat", 270: "pselect6", 271: "ppoll",
               281: "epoll_pwait", 288: "accept4", 437: "openat2"},
    "aarch64": {63: "read", 64: "write", 65: "readv", 66: "writev", 25: "fcntl", 32: "flock",
                82: "fsync", 98: "futex", 101: "nanosleep", 115: "clock_nanosleep",
                56: "openat", 72: "pselect6", 73: "ppoll", 22: "epoll_pwait", 202: "accept",
                203: "connect", 206: "sendto", 207: "recvfrom", 211: "sendmsg",
                212: "recvmsg", 242: "accept4", 260: "wait4", 437: "openat2"},
}
_FD_CALLS = ("read", "write", "readv", "writev", "recvfrom", "recvmsg", "sendto", "sendmsg",
             "accept", "accept4", "connect", "flock", "fcntl", "fsync")
_LOCK_WCHANS = ("locks_lock_inode_wait", "flock_lock_inode_wait", "locks_lock_file_wait",
                "__flock_lock_file", "fcntl_setlk", "posix_lock_inode_wait", "flock_lock_file_wait")
_FIFO_WCHANS = ("wait_for_partner", "fifo_open")
F_SETLKW = (7, 38)  # F_SETLKW, F_OFD_SETLKW
# Waits that explain a stall by themselves; a futex or poll wait is what every rank
# waiting in a collective shows too, so it explains nothing on its own.
TELLING_WAITS = ("file_lock", "fifo_open", "file_open", "pipe", "fifo", "socket", "file_io",
                 "disk_io")
MAX_THREADS = 256
MAX_FD_SCAN = 50000


def thread_waits(pid: int, proc_root: str = "/proc") -> list[dict[str, Any]]:
    """Every thread of ``pid`` with what it waits in; [] if the process is not readable.

    Each entry: ``tid``, ``name``, ``state`` (the kernel letter), ``wchan``, ``syscall``
    (name or number) and ``wait``: a classified cause (``classify_wait``) or None.
    """
    arch = os.uname().machine
    table = _SYSCALLS.get(arch, {})
    threads = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"{proc_root}/{pid}/task"))[:MAX_THREADS]
    except (OSError, ValueError):
        return []
    locks = None
    for tid in tids:
        base = f"{proc_root}/{pid}/task/{tid}"
        stat = _read(f"{base}/stat")
        if stat is None:
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        state = stat[stat.rfind(")") + 2:][:1]
        wchan = (_read(f"{base}/wchan") or "").strip()
        if wchan == "0":
            wchan = ""
        call, args = _syscall(_read(f"{base}/syscall"), table)
        entry: dict[str, Any] = {"tid": tid, "name": name, "state": state, "wchan": wchan,
                                 "syscall": call}
        if (call in ("flock", "fcntl") or wchan in _LOCK_WCHANS) and locks is None:
            locks = read_locks(proc_root)
        entry["wait"] = classify_wait(pid, call, args, wchan, state, locks or [], proc_root)
        threads.append(entry)
    return threads


def classify_wait(pid: int, call: Any, args: list[int], wchan: str, state: str,
                  locks: list[dict[str, Any]], proc_root: str = "/proc") -> dict[str, Any] | None:
    """What one thread waits for: ``kind`` plus the holder, peer or file where known."""
    if call == "flock" or wchan in _LOCK_WCHANS or (call == "fcntl" and len(args) > 1
                                                      and args[1] in F_SETLKW):
        fd = args[0] if args else None
        target = fd_target(pid, fd, proc_root) if fd is not None else {}
        wanted = [lk for lk in locks if lk["blocked"] and lk["pid"] == pid]
        holders = []
        for w in wanted:
            holders += [lk for lk in locks if not lk["blocked"] and lk["id"] == w["id"]
                        and lk["inode"] == w["inode"]]
        if not holders and target.get("inode") is not None:
            holders = [lk for lk in locks if not lk["blocked"] and lk["inode"] == target["inode"]]
        holder = holders[0] if holders else None
        return {"kind": "file_lock", "lock": (holder or (wanted[0] if wanted else {})).get("type"),
                "path": target.get("path"), "mount": target.get("mount"),
                "holder": _process(holder["pid"], proc_root) if holder and holder["pid"] > 0
                else None}
    if call in ("open", "openat", "openat2") and (wchan in _FIFO_WCHANS or state == "S"):
        addr = args[0] if call == "open" else (args[1] if len(args) > 1 else None)
        path = read_string(pid, addr, proc_root) if addr else None
        if path and call != "open" and not path.startswith("/") and args and \
                args[0] != 0xFFFFFF9C and args[0] < 1 << 31:
            base = fd_target(pid, args[0], proc_root).get("path")
            path = os.path.join(base, path) if base else path
        is_fifo = wchan in _FIFO_WCHANS or _is_fifo(path)
        if not is_fifo:
            return {"kind": "file_open", "path": path, "mount": mount_of(pid, path, proc_root)}
        return {"kind": "fifo_open", "path": path,
                "peers": holders_of(path=path, exclude=pid, proc_root=proc_root) if path else [],
                "mount": mount_of(pid, path, proc_root)}
    if call in _FD_CALLS and args:
        target = fd_target(pid, args[0], proc_root)
        kind = target.get("type")
        if kind in ("pipe", "fifo"):
            other_end = "write" if "read" in str(call) or "recv" in str(call) else \
                "read" if "write" in str(call) or "send" in str(call) else None
            peers = holders_of(inode=target.get("inode"), path=target.get("path"), exclude=pid,
                               proc_root=proc_root, end=other_end)
            return {"kind": kind, "direction": call, "path": target.get("path"),
                    "peers": peers}
        if kind == "socket":
            return {"kind": "socket", "direction": call, **socket_peer(
                target.get("inode"), exclude=pid, proc_root=proc_root)}
        if kind == "file" or state == "D":
            return {"kind": "disk_io" if state == "D" else "file_io", "direction": call,
                    "path": target.get("path"), "mount": target.get("mount")}
    if state == "D":
        return {"kind": "disk_io", "wchan": wchan}
    if call == "futex" or wchan.startswith("futex"):
        return {"kind": "futex", "address": hex(args[0]) if args else None}
    if call in ("poll", "ppoll", "select", "pselect6", "epoll_wait", "epoll_pwait"):
        return {"kind": "poll"}
    if call in ("nanosleep", "clock_nanosleep"):
        return {"kind": "sleep"}
    if call == "wait4":
        return {"kind": "child"}
    return None


def read_locks(proc_root: str = "/proc") -> list[dict[str, Any]]:
    """/proc/locks: every lock and every blocked waiter (``->`` lines), with dev:inode."""
    text = _read(f"{proc_root}/locks") or ""
    locks = []
    for line in text.splitlines():
        parts = line.split()
        blocked = len(parts) > 1 and parts[1] == "->"
        if blocked:
            parts = [parts[0]] + parts[2:]
        if len(parts) < 6:
            continue
        try:
            ident, lpid = int(parts[0].rstrip(":")), int(parts[4])
            major, minor, inode = parts[5].split(":")
        except ValueError:
            continue
        locks.append({"id": ident, "blocked": blocked, "type": parts[1].lower(),
                      "mode": parts[3].lower(), "pid": lpid,
                      "dev": f"{major}:{minor}", "inode": int(inode)})
    return locks


def fd_target(pid: int, fd: int, proc_root: str = "/proc") -> dict[str, Any]:
    """What an fd is: ``type`` pipe / socket / fifo / file / other, with inode, path, mount."""
    link = f"{proc_root}/{pid}/fd/{fd}"
    try:
        target = os.readlink(link)
    except OSError:
        return {}
    for kind in ("pipe", "socket"):
        if target.startswith(f"{kind}:["):
            return {"type": kind, "fd": fd, "inode": int(target[len(kind) + 2:-1])}
    try:
        st = os.stat(link)
    except OSError:
        return {"type": "other", "fd": fd, "path": target}
    import stat as stat_mod
    kind = "fifo" if stat_mod.S_ISFIFO(st.st_mode) else "file" if \
        stat_mod.S_ISREG(st.st_mode) or stat_mod.S_ISDIR(st.st_mode) else "other"
    return {"type": kind, "fd": fd, "path": target, "inode": st.st_ino,
            "mount": mount_of(pid, target, proc_root)}


def holders_of(inode: int | None = None, path: str | None = None, exclude: int | None = None,
               proc_root: str = "/proc", end: str | None = None) -> list[dict[str, Any]]:
    """Other processes with the pipe inode or the path open (the other end's candidates);
    with ``end`` ("read"/"write"), only those whose fd is open for it (its fdinfo flags):
    a reader blocked on a pipe waits for a writer, not for a fellow reader."""
    wanted = {f"pipe:[{inode}]"} if inode is not None else set()
    if path:
        wanted.add(path)
    found: dict[int, dict[str, Any]] = {}
    scanned = 0
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        try:
            fds = os.listdir(f"{proc_root}/{entry.name}/fd")
        except OSError:
            continue
        for fd in fds:
            scanned += 1
            if scanned > MAX_FD_SCAN:
                return list(found.values())
            try:
                if os.readlink(f"{proc_root}/{entry.name}/fd/{fd}") in wanted and \
                        _open_for(f"{proc_root}/{entry.name}/fdinfo/{fd}", end):
                    found[int(entry.name)] = _process(int(entry.name), proc_root)
                    break
            except OSError:
                continue
    return list(found.values())


def _open_for(fdinfo: str, end: str | None) -> bool:
    """Whether the fd (its ``flags`` in fdinfo, octal) is open for reading or writing;
    True when ``end`` is None or the flags cannot be read (kept, not guessed away)."""
    flags = next((ln.split()[1] for ln in (_read(fdinfo) or "").splitlines()
                  if ln.startswith("flags:")), None)
    if end is None or flags is None:
        return True
    mode = int(flags, 8) & os.O_ACCMODE
    return mode == os.O_RDWR or mode == (os.O_RDONLY if end == "read" else os.O_WRONLY)


def socket_peer(inode: int | None, exclude: int | None = None,
                proc_root: str = "/proc") -> dict[str, Any]:
    """A socket's protocol, local and remote address, and the local process at the other end."""
    if inode is None:
        return {}
    for proto in ("tcp", "tcp6"):
        rows = _net_rows(f"{proc_root}/net/{proto}")
        mine = next((r for r in rows if r["inode"] == inode), None)
        if mine is None:
            continue
        out: dict[str, Any] = {"protocol": proto, "local": mine["local"],
                               "remote": mine["remote"], "peer": None}
        other = next((r for r in rows if r["local"] == mine["remote"]
                      and r["remote"] == mine["local"] and r["inode"]), None)
        if other is not None:
            procs = holders_of(path=f"socket:[{other['inode']}]", exclude=None,
                               proc_root=proc_root)
            out["peer"] = procs[0] if procs else None
        return out
    paths = {int(parts[6]): parts[7] if len(parts) > 7 else ""
             for parts in (line.split() for line in
                           (_read(f"{proc_root}/net/unix") or "").splitlines()[1:])
             if len(parts) >= 7 and parts[6].isdigit()}
    if inode in paths:  # its peer from sock_diag; its holders may be the waiter itself
        peer_ino = unix_peer.peer_inode(inode)
        peers = [{**p, "self": p["pid"] == exclude} for p in holders_of(
            path=f"socket:[{peer_ino}]", proc_root=proc_root)] if peer_ino else []
        return {"protocol": "unix", "local": paths[inode], "remote": paths.get(peer_ino or -1)
                or None, "peer": next((p for p in peers if not p["self"]), None),
                "peer_inode": peer_ino, "peers": peers}
    return {"protocol": "unknown"}


def mount_of(pid: int, path: str | None, proc_root: str = "/proc") -> dict[str, Any] | None:
    """The mount a path lives on (longest mount point prefix in the process's mountinfo)."""
    if not path or not path.startswith("/"):
        return None
    best = None
    for line in (_read(f"{proc_root}/{pid}/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and \
                (best is None or len(point) > len(best["mountpoint"])):
            best = {"mountpoint": point, "fstype": rest[0], "source": rest[1]}
    return best


def read_string(pid: int, address: int, proc_root: str = "/proc", limit: int = 4096) -> str | None:
    """A NUL-terminated string from the process's memory (needs ptrace access; else None)."""
    try:
        with open(f"{proc_root}/{pid}/mem", "rb", buffering=0) as mem:
            mem.seek(address)
            data = mem.read(limit)
    except (OSError, OverflowError, ValueError):
        return None
    return data.split(b"\0", 1)[0].decode("utf-8", "replace") or None


def _process(pid: int, proc_root: str = "/proc") -> dict[str, Any]:
    raw = _read(f"{proc_root}/{pid}/cmdline") or ""
    return {"pid": pid, "cmdline": " ".join(raw.split("\0")).strip()[:300]}


def _is_fifo(path: str | None) -> bool:
    import stat as stat_mod
    try:
        return path is not None and stat_mod.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _syscall(text: str | None, table: dict[int, str]) -> tuple[Any, list[int]]:
    """(name or number or 'running'/None, args) from a task's ``syscall`` file."""
    if not text:
        return None, []
    parts = text.split()
    if parts[0] == "running":
        return "running", []
    try:
        number = int(parts[0])
        args = [int(p, 16) for p in parts[1:7]]
    except ValueError:
        return None, []
    return table.get(number, number), args


def _net_rows(path: str) -> list[dict[str, Any]]:
    rows = []
    for line in (_read(path) or "").splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        try:
            rows.append({"local": _addr(parts[1]), "remote": _addr(parts[2]),
                         "inode": int(parts[9])})
        except ValueError:
            continue
    return rows


def _addr(hexaddr: str) -> str:
    """/proc/net/tcp's ADDR:PORT in hex (host byte order per 32-bit word) -> 'ip:port'."""
    import ipaddress
    import struct
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0])
                     for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    return f"[{ip}]:{int(port, 16)}" if ip.version == 6 else f"{ip}:{int(port, 16)}"


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as fh:
            return fh.read(1 << 20)
    except OSError:
        return None


def describe_wait(wait: dict[str, Any]) -> str:
    """One line a human reads: what a thread waits for, and who holds the other end."""
    kind = wait.get("kind")
    if kind == "file_lock":
        holder = wait.get("holder")
        who = (f"held by pid {holder['pid']} ({holder['cmdline'] or '?'})" if holder
               else "held by a process not visible here (another node or pid namespace)")
        return f"waits for a file lock ({wait.get('lock') or '?'}) on " \
               f"{wait.get('path') or '?'}{_mount(wait)}, {who}"
    if kind == "fifo_open":
        return f"blocked opening FIFO {wait.get('path') or '?'}{_mount(wait)}: " + \
            _peers(wait.get("peers"), "no other process has it open (nobody will write)")
    if kind in ("pipe", "fifo"):
        return f"blocked in {wait.get('direction')} on a {kind} " \
               f"{wait.get('path') or ''}".rstrip() + ": " + \
            _peers(wait.get("peers"), "no other process holds its other end")
    if kind == "socket" and wait.get("protocol") == "unix":
        return unix_peer.describe_unix_wait(wait)
    if kind == "socket":
        peer = wait.get("peer")
        who = (f"peer pid {peer['pid']} ({peer['cmdline'] or '?'})" if peer
               else "the peer is not on this host")
        return (f"blocked in {wait.get('direction')} on a {wait.get('protocol', '?')} socket "
                f"{wait.get('local') or '?'} -> {wait.get('remote') or '?'}; {who}")
    if kind in ("file_io", "file_open", "disk_io"):
        what = "uninterruptible I/O" if kind == "disk_io" else f"{wait.get('direction') or 'open'}"
        return f"blocked in {what} on {wait.get('path') or wait.get('wchan') or '?'}" + \
            _mount(wait)
    return str(kind)


def _mount(wait: dict[str, Any]) -> str:
    m = wait.get("mount")
    return f" (on {m['mountpoint']}, {m['fstype']} {m['source']})" if m else ""


def _peers(peers: list[dict[str, Any]] | None, none: str) -> str:
    if not peers:
        return none
    return "other end held by " + ", ".join(f"pid {p['pid']} ({p['cmdline'] or '?'})"
                                            for p in peers[:3])


def main_thread_wait(pid: Any, proc_root: str = "/proc") -> dict[str, Any] | None:
    """What the process's main thread waits on, when that alone explains a stall."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    main = next((t for t in thread_waits(pid, proc_root) if t["tid"] == pid), None)
    wait = (main or {}).get("wait") or {}
    if main is None or wait.get("kind") not in TELLING_WAITS:
        return None
    return {**wait, "thread": {"tid": main["tid"], "wchan": main["wchan"],
                               "syscall": main["syscall"]}}


def reused(created: float, started_at: Any, created_at: Any) -> bool:
    """Does the pid belong to another process than the rank that published it?"""
    if isinstance(created_at, (int, float)) and not isinstance(created_at, bool):
        return abs(created - created_at) > 1.0  # the kernel's clock both times
    return isinstance(started_at, (int, float)) and created > started_at + 2


def still_running(status: dict[str, Any]) -> bool | None:
    """May the process a rank's status names still run on this host? False when it is gone,
    a zombie, or the pid now belongs to another process; True when it runs, or is there
    but not this user's to look at; None when the status names no pid."""
    pid = status.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and not reused(
            proc.create_time(), status.get("started_at"), status.get("process_created_at"))
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
