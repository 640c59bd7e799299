"""The newest checkpoint, its age, recent save failures, and the space left for the next one.

Checkpoint manifests follow docs/checkpoints.md (a ``step-NNNNNNNN`` directory per
checkpoint with a ``manifest.json`` listing every file's ``bytes`` and ``sha256``;
names starting with "." are saves in progress); diagnose reads manifests and file sizes but does not re-hash
the data (``trainwatch checkpoint verify DIR`` does). Without manifests it falls
back to what the journal and the status files say, and otherwise says "unknown".
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from trainwatch.diagnose import journal
from trainwatch.diagnose.model import Evidence
from trainwatch.rundir import RunDir

CHECKPOINT_FORMAT = "trainwatch.checkpoint"


def gather(run: RunDir, ev: Evidence) -> None:
    info: dict[str, Any] = {"dir": str(run.checkpoint_dir), "newest": None}
    manifests = [m for m in (read_manifest(d) for d in _dirs(run.checkpoint_dir)) if m]
    if manifests:
        newest = max(manifests, key=lambda m: (m.get("step") or -1, m.get("time") or 0))
        info["newest"] = {**newest, "source": "manifest"}
    else:
        saved = journal.recent(ev, "checkpoint_saved")
        from_status = [v["checkpoint"] for v in ev.ranks.values()
                       if isinstance(v.get("checkpoint"), dict) and v["checkpoint"].get("ok")]
        candidates = ([{**r, "source": "journal"} for r in saved]
                      + [{**c, "source": "status"} for c in from_status])
        if candidates:
            info["newest"] = max(candidates, key=lambda c: (c.get("step") or -1))
    if info["newest"] and isinstance(info["newest"].get("time"), (int, float)):
        info["newest"]["age_seconds"] = round(ev.collected_at - info["newest"]["time"], 1)
    if info["newest"] is None:
        info["newest_text"] = "unknown (no manifest, journal event or status entry found)"
    info["failures"] = [{k: r.get(k) for k in ("time", "step", "error", "path", "rank")}
                        for r in journal.recent(ev, "checkpoint_failed")]
    info["failures"] += [{"time": None, "step": v["checkpoint"].get("step"),
                          "error": v["checkpoint"].get("error"), "rank": r}
                         for r, v in ev.ranks.items() if isinstance(v.get("checkpoint"), dict)
                         and v["checkpoint"].get("ok") is False]
    info["disk"] = disk(run.checkpoint_dir if run.checkpoint_dir.exists() else run.root)
    ev.checkpoints = info


def _dirs(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """A manifest whose listed files are all present with their sizes, else None."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format", CHECKPOINT_FORMAT) != \
            CHECKPOINT_FORMAT:
        return None
    files = manifest.get("files") or {}
    if not isinstance(files, dict):
        return None
    for name, meta in files.items():
        size = (meta.get("bytes", meta.get("size"))) if isinstance(meta, dict) else None
        try:
            if size is not None and (directory / str(name)).stat().st_size != size:
                return None
        except OSError:
            return None
    time_ = manifest.get("time") or manifest.get("created_at")
    if time_ is None:
        try:
            time_ = (directory / "manifest.json").stat().st_mtime
        except OSError:
            time_ = None
    return {"path": str(directory), "step": manifest.get("step"), "time": time_}


def disk(path: Path) -> dict[str, Any]:
    try:
        usage = shutil.disk_usage(path)
        st = os.statvfs(path)
    except OSError as exc:
        return {"path": str(path), "error": exc.strerror}
    return {"path": str(path), "total_bytes": usage.total, "free_bytes": usage.free,
            "free_ratio": round(usage.free / usage.total, 4) if usage.total else None,
            "files_free": st.f_favail}
