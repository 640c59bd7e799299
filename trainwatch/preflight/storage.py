"""Storage checks: do the job's directories exist, take writes, and have room?

Built on the host storage probes the agent uses too: every filesystem call runs behind a
``Deadline`` (a hung NFS/Lustre mount becomes a failed check after
``probe_timeout_seconds``, never a hung prolog), and the write probe is the agent's
write + fsync + read back.
Free space is what a non-root user may use (``f_bavail``), like the job sees it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from trainwatch.host.storage import mount_of, parse_mounts, write_probe
from trainwatch.host.timeouts import Deadline, Hung
from trainwatch.preflight.model import Check, Request
from trainwatch.units import human_bytes


def check_storage(request: Request, cfg: dict[str, Any], proc_root: str,
                  deadline: Deadline | None = None) -> list[Check]:
    """Every given directory.  Without --checkpoint-dir, the room for --checkpoint-bytes
    is checked in the run directory (checkpoints go below it by default)."""
    dirs = [(role, path) for role, path in (("run", request.run_dir),
                                            ("checkpoint", request.checkpoint_dir),
                                            ("data", request.data_dir)) if path is not None]
    if not dirs:
        return [Check("storage.dirs", "skipped",
                      "no directory given (--run-dir, --checkpoint-dir, --data-dir)")]
    try:
        mounts = parse_mounts(Path(proc_root, "self", "mounts").read_text())
    except OSError:
        mounts = []
    deadline = deadline or Deadline()
    room_role = "checkpoint" if request.checkpoint_dir is not None else "run"
    checks: list[Check] = []
    for role, path in dirs:
        checkpoint_bytes = request.checkpoint_bytes if role == room_role else None
        checks += check_directory(role, str(path), cfg, mounts, deadline, checkpoint_bytes)
    return checks


def check_directory(role: str, path: str, cfg: dict[str, Any], mounts: list, deadline: Deadline,
                    checkpoint_bytes: int | None = None) -> list[Check]:
    """``storage.<role>.writable`` (or ``.readable``), ``.space`` and ``.inodes``."""
    timeout = float(cfg["probe_timeout_seconds"])
    writable = role != "data" or cfg["data_dir_writable"]
    access_id = f"storage.{role}.{'writable' if writable else 'readable'}"
    later = (f"storage.{role}.space", f"storage.{role}.inodes")

    def stopped(status: str, message: str, evidence: dict[str, Any]) -> list[Check]:
        return [Check(access_id, status, message, evidence, runbook="StorageFull")] + [
            Check(id_, "skipped", f"not checked: {message}") for id_ in later]

    evidence: dict[str, Any] = {"path": path}
    try:
        is_dir, real, vfs = deadline.call(f"stat:{path}", lambda: (
            os.path.isdir(path), os.path.realpath(path), os.statvfs(path)), timeout)
    except FileNotFoundError:
        return stopped("fail", f"{path} does not exist", evidence)
    except Hung as exc:
        return stopped("fail", f"{path}: statvfs {exc}", evidence)
    except OSError as exc:
        return stopped("fail", f"{path}: {exc.strerror or exc}", evidence)
    if not is_dir:
        return stopped("fail", f"{path} is not a directory", evidence)
    mount = mount_of(real, mounts)
    size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    readonly = bool(vfs.f_flag & os.ST_RDONLY)
    evidence.update({"realpath": real, "mountpoint": mount[1] if mount else None,
                     "fstype": mount[2] if mount else None, "size_bytes": size,
                     "free_bytes": free, "files": vfs.f_files, "files_free": vfs.f_favail,
                     "readonly": readonly})
    checks = [_access(access_id, path, writable, readonly, cfg, deadline, evidence)]
    checks.append(_space(role, path, size, free, cfg, checkpoint_bytes, evidence))
    checks.append(_inodes(role, path, vfs, cfg, evidence))
    return checks


def _access(id_: str, path: str, writable: bool, readonly: bool, cfg: dict[str, Any],
            deadline: Deadline, evidence: dict[str, Any]) -> Check:
    timeout = float(cfg["probe_timeout_seconds"])
    if not writable:
        try:
            deadline.call(f"list:{path}", lambda: next(os.scandir(path), None), timeout)
        except Hung as exc:
            return Check(id_, "fail", f"{path}: listing {exc}", evidence)
        except OSError as exc:
            return Check(id_, "fail", f"{path} cannot be listed: {exc.strerror or exc}",
                         evidence)
        return Check(id_, "ok", f"{path} readable" + (" (read-only mount)" if readonly else ""),
                     evidence)
    if readonly:
        return Check(id_, "fail", f"{path} is on a read-only filesystem "
                     f"({evidence['mountpoint']})", evidence, runbook="StorageFull")
    size = int(cfg["probe_bytes"])
    try:
        seconds = deadline.call(f"probe:{path}", lambda: write_probe(
            path, size, socket.gethostname()), timeout)
    except Hung as exc:
        return Check(id_, "fail", f"{path}: write probe {exc}", evidence,
                     runbook="StorageProbeSlow")
    except OSError as exc:
        return Check(id_, "fail", f"{path}: write probe failed: {exc.strerror or exc}",
                     evidence, runbook="StorageFull")
    evidence["probe_seconds"] = round(seconds, 6)
    return Check(id_, "ok", f"{path} takes writes ({size} B write+fsync+read in "
                 f"{seconds * 1000:.1f} ms)", evidence)


def _space(role: str, path: str, size: int, free: int, cfg: dict[str, Any],
           checkpoint_bytes: int | None, evidence: dict[str, Any]) -> Check:
    id_ = f"storage.{role}.space"
    room = int(cfg["checkpoint_room"]) * (checkpoint_bytes or 0)
    need = max(int(cfg["min_free_bytes"]), room)
    evidence["need_bytes"] = need
    text = f"{human_bytes(free)} free of {human_bytes(size)}"
    if free < need:
        why = (f"room for {cfg['checkpoint_room']} checkpoint(s) of "
               f"{human_bytes(checkpoint_bytes or 0)}" if room == need
               else "storage.min_free_bytes")
        return Check(id_, "fail", f"{path}: only {text}, need {human_bytes(need)} ({why})",
                     evidence, runbook="StorageFull")
    if size and free / size < float(cfg["warn_free_ratio"]):
        return Check(id_, "warn", f"{path}: {text} (under {cfg['warn_free_ratio']:.0%})",
                     evidence, runbook="StorageFillingUp")
    return Check(id_, "ok", f"{path}: {text}" + (f" (need {human_bytes(need)})" if need else ""),
                 evidence)


def _inodes(role: str, path: str, vfs: os.statvfs_result, cfg: dict[str, Any],
            evidence: dict[str, Any]) -> Check:
    id_ = f"storage.{role}.inodes"
    if vfs.f_files == 0:
        return Check(id_, "skipped", f"{path}: the filesystem does not report inodes",
                     evidence)
    if vfs.f_favail < int(cfg["min_free_inodes"]):
        return Check(id_, "fail", f"{path}: only {vfs.f_favail} free inodes of {vfs.f_files}, "
                     f"need {cfg['min_free_inodes']}", evidence, runbook="StorageFull")
    return Check(id_, "ok", f"{path}: {vfs.f_favail} free inodes", evidence)
