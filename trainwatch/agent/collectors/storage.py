"""Storage: the run, checkpoint and data directories the ranks depend on.

Per directory: filesystem size, free bytes and inodes, read-only state, a small
write + fsync + read probe, and a time-to-full prediction from the recent fill rate.
Every filesystem call runs behind a deadline (``trainwatch/host/timeouts.py``): a hung
mount is reported as an error for that directory; the agent and the other directories carry on.
Block-device I/O counters come from /proc/diskstats for the devices behind them.
"""

from __future__ import annotations

import errno
import math
import os
import time
from collections import deque
from typing import Any

from trainwatch.agent.registry import Collector, Result, register
from trainwatch.host.storage import mount_of, parse_diskstats, parse_mounts, write_probe
from trainwatch.host.timeouts import Deadline, Hung


def time_to_full(history: deque) -> float:
    """Seconds until free bytes hit 0 at the least-squares fill rate; inf if not filling."""
    if len(history) < 3:
        return math.inf
    t0 = history[0][0]
    xs = [t - t0 for t, _ in history]
    ys = [f for _, f in history]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 0:
        return math.inf
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    if slope >= 0:
        return math.inf
    return max(0.0, ys[-1] / -slope)


# Free space is read every 5 s (a statvfs is cheap), so a disk that fills is named within
# seconds of the first write it fails; the write probe (a write and an fsync) runs less often.
@register("storage", interval=5.0, timeout=30.0, first_delay=1.5, options={
    "paths": [],               # extra directories: [{path: /data, role: data}, ...]
    "probe": True,             # write+fsync+read probe in each directory
    "probe_interval": 15.0,    # seconds between probes of a directory (its result is kept)
    "probe_bytes": 4096,
    "probe_timeout": 5.0,      # per directory; a hung mount becomes an error
    "history_seconds": 600.0,  # window of the fill-rate regression
})
class StorageCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self.deadline = Deadline()
        self.history: dict[str, deque] = {}
        self.probes: dict[str, tuple[float, dict[str, Any]]] = {}  # path: (when, result)

    def _targets(self) -> list[tuple[str, str, str]]:
        """(path, role, job) for every run's dir and checkpoint dir plus configured paths."""
        targets, seen = [], set()
        ranks = self.ctx.store.data("ranks") or {}
        jobs = {j["run_dir"]: j["job"] for j in ranks.get("jobs", [])}
        for run in self.ctx.run_dirs():
            job = jobs.get(str(run.root), run.root.name)
            folders = run.checkpoint_folders()
            for folder, role in ((run.root, "run"), *((f, "checkpoint") for f in folders)):
                if str(folder) not in seen:
                    seen.add(str(folder))
                    targets.append((str(folder), role, job))
        for entry in self.options["paths"]:
            if isinstance(entry, str):
                entry = {"path": entry}
            path = str(entry.get("path", "")) if isinstance(entry, dict) else ""
            if path and path not in seen:
                seen.add(path)
                targets.append((path, str(entry.get("role", "data")), str(entry.get("job", ""))))
        return targets

    def collect(self) -> Result:
        result = Result()
        try:
            mounts = parse_mounts(self.ctx.proc_path("self", "mounts").read_text())
        except OSError:
            mounts = []
        timeout = float(self.options["probe_timeout"])
        entries: list[dict[str, Any]] = []
        devices: set[str] = set()
        for path, role, job in self._targets():
            entries.append(self._one(path, role, job, mounts, timeout, result, devices))
        try:
            stats = parse_diskstats(self.ctx.proc_path("diskstats").read_text())
        except OSError:
            stats = {}
        for device in sorted(devices):
            s = stats.get(device)
            if s is None:
                continue
            lab = {"node": self.ctx.node, "device": device}
            result.add("trainwatch_storage_read_bytes_total", s["read_bytes"], **lab)
            result.add("trainwatch_storage_written_bytes_total", s["written_bytes"], **lab)
            result.add("trainwatch_storage_io_time_seconds_total", s["io_seconds"], **lab)
        result.data = entries
        return result

    def _one(self, path, role, job, mounts, timeout, result, devices) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": path, "role": role, "job": job, "mountpoint": None,
                                 "error": None}
        try:
            real, vfs = self.deadline.call(f"stat:{path}", lambda: (
                os.path.realpath(path), os.statvfs(path)), timeout)
        except FileNotFoundError:
            entry["error"] = "does not exist"
            return entry
        except (Hung, OSError) as exc:
            entry["error"] = f"statvfs: {exc}"
            mount = mount_of(os.path.abspath(path), mounts)
            if mount is not None:
                entry["mountpoint"] = mount[1]
                result.add("trainwatch_storage_probe_success", 0, node=self.ctx.node, run=job,
                           role=role, mountpoint=mount[1])
            return entry
        mount = mount_of(real, mounts)
        mountpoint = mount[1] if mount else "/"
        if mount and mount[0].startswith("/dev/"):
            devices.add(os.path.basename(mount[0]))
        lab = {"node": self.ctx.node, "run": job, "role": role, "mountpoint": mountpoint}
        size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
        readonly = bool(vfs.f_flag & os.ST_RDONLY)
        history = self.history.setdefault(path, deque(maxlen=240))
        now = time.time()
        history.append((now, free))
        while history and history[0][0] < now - float(self.options["history_seconds"]):
            history.popleft()
        ttf = time_to_full(history)
        result.add("trainwatch_storage_size_bytes", size, **lab)
        result.add("trainwatch_storage_free_bytes", free, **lab)
        result.add("trainwatch_storage_files", vfs.f_files, **lab)
        result.add("trainwatch_storage_files_free", vfs.f_favail, **lab)
        result.add("trainwatch_storage_readonly", readonly, **lab)
        result.add("trainwatch_storage_time_to_full_seconds", ttf, **lab)
        entry.update({"mountpoint": mountpoint, "fstype": mount[2] if mount else None,
                      "size_bytes": size, "free_bytes": free, "files": vfs.f_files,
                      "files_free": vfs.f_favail, "readonly": readonly,
                      "time_to_full_seconds": None if math.isinf(ttf) else round(ttf, 1)})
        if self.options["probe"]:
            probe = self._probe(path, timeout)
            if probe.get("skipped"):
                result.add("trainwatch_storage_probe_skipped", 1, **lab)
                entry["probe"] = probe
                return entry
            result.add("trainwatch_storage_probe_skipped", 0, **lab)
            if probe["seconds"] is not None:
                result.add("trainwatch_storage_probe_duration_seconds", probe["seconds"], **lab)
            result.add("trainwatch_storage_probe_success", probe["ok"], **lab)
            entry["probe"] = probe
        return entry

    def _probe(self, path: str, timeout: float) -> dict[str, Any]:
        """The write probe of ``path``: run when the last is ``probe_interval`` old, else
        the last result again (the series stay put between probes)."""
        now = time.monotonic()
        last = self.probes.get(path)
        if last is not None and now - last[0] < float(self.options["probe_interval"]):
            return last[1]
        probe: dict[str, Any] = {"ok": False, "seconds": None, "error": None}
        try:
            seconds = self.deadline.call(f"probe:{path}", lambda: write_probe(
                path, int(self.options["probe_bytes"]), self.ctx.node), timeout)
            probe.update(ok=True, seconds=round(seconds, 6))
        except Hung as exc:
            probe["error"] = f"probe hung: {exc}"
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                # The job's own directory (0750, the agent reads through its group): not
                # a slow disk, so no StorageProbeSlow; said here and counted.
                probe["skipped"] = (f"the agent's user may not write here ({exc.strerror}); "
                                    "list a folder it may write on this filesystem in "
                                    "collectors.storage.paths")
            else:
                probe["error"] = f"probe failed: {exc.strerror or exc}"
        self.probes[path] = (now, probe)
        return probe
