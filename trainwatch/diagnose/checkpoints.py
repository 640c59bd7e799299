"""The newest checkpoint, its age, recent save failures, and the space left for the next one.

Checkpoints are looked for wherever the run put them (``checkpoint_dirs`` in its
run.json) and read with the checkpoint library's strict, torch-free manifest reader
(docs/checkpoints.md); diagnose checks that every listed file is there with its size but
does not re-hash the data (``trainwatch checkpoint verify DIR`` does). Without manifests it
falls back to what the journal and the status files say, and otherwise says "unknown".
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from trainwatch.diagnose import journal
from trainwatch.diagnose.model import Evidence
from trainwatch.rundir.run_dir import RunDir
from trainwatch.checkpoint_format.catalog import complete
from trainwatch.checkpoint_format.manifest import verify


def gather(run: RunDir, ev: Evidence) -> None:
    folders = run.checkpoint_folders()
    info: dict[str, Any] = {"dir": str(folders[0]), "dirs": [str(f) for f in folders],
                            "newest": None}
    manifests = [m for folder in folders for m in newest_intact(folder)]
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
    info["failures"] = failures(ev)
    info["disk"] = disk(folders[0] if folders[0].exists() else run.root)
    ev.checkpoints = info


def failures(ev: Evidence) -> list[dict[str, Any]]:
    """Failed saves, oldest first, each with its reason: the journal's ``checkpoint_failed``
    events (``error``), and for a rank whose status says its last save failed but whose
    failure the journal does not hold (unreadable, or beyond its recent events) the
    status's ``last_error`` with the step it was saving (``in_flight_step``) and its
    ``failures_total`` (``count``)."""
    found = [{k: r.get(k) for k in ("time", "step", "error", "path", "rank")}
             for r in journal.recent(ev, "checkpoint_failed")]
    journaled = {f.get("rank") for f in found}
    for rank, status in ev.ranks.items():
        facts = status.get("checkpoint")
        if isinstance(facts, dict) and facts.get("ok") is False and rank not in journaled:
            found.append({"time": None, "step": facts.get("in_flight_step"),
                          "error": facts.get("last_error"), "rank": rank,
                          "count": facts.get("failures_total")})
    return found


def newest_intact(folder: Path) -> list[dict[str, Any]]:
    """The newest checkpoint in ``folder`` whose listed files are all there with their
    sizes (no hashing), as [{path, step, time}], or [] when there is none."""
    for entry in complete(folder):
        check = verify(entry.path, full=False)
        if check.ok and entry.manifest is not None:
            return [{"path": str(entry.path), "step": entry.step,
                     "time": entry.manifest.get("created_at")}]
    return []


def disk(path: Path) -> dict[str, Any]:
    try:
        usage = shutil.disk_usage(path)
        st = os.statvfs(path)
    except OSError as exc:
        return {"path": str(path), "error": exc.strerror}
    return {"path": str(path), "total_bytes": usage.total, "free_bytes": usage.free,
            "free_ratio": round(usage.free / usage.total, 4) if usage.total else None,
            "files_free": st.f_favail}
