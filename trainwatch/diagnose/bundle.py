"""``--bundle FILE``: a tar.gz of everything gathered, secrets redacted, to attach to a ticket.

Contents: report.json (findings + evidence), report.txt (the human report),
run.json, status files, journal and metrics tails, launcher/rank log tails, the
ranks' diagnostic dumps and the environment of each local rank. Every member
passes through ``redact`` before it is written; nothing is copied raw.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import rank_file_name
from trainwatch.diagnose.model import Evidence
from trainwatch.redact import redact, redact_env, redact_text
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import SkippedFile, read_run_file_tail

TAIL_BYTES = 256 * 1024
MAX_FILES_PER_FOLDER = 500


def write(path: str | Path, run: RunDir, ev: Evidence, report: dict[str, Any],
          text_report: str) -> Path:
    path = Path(path)
    members: dict[str, bytes] = {
        "report.json": _json(report),  # already redacted by render_json
        "report.txt": redact_text(text_report).encode(),
    }
    for name, source in _run_files(run):
        members[name] = redact_text(_tail(source, run.root)).encode()
    for rank, v in ev.ranks.items():
        env = environment(v.get("pid")) if (v.get("process") or {}).get("visible") else None
        if env is not None:
            members[f"environment/{rank_file_name(rank, '.json')}"] = _json(redact_env(env))
    prefix = f"trainwatch-diagnose-{time.strftime('%Y%m%dT%H%M%S')}"
    tmp = path.with_name(f".{path.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(f"{prefix}/{name}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
    return path


def _run_files(run: RunDir) -> list[tuple[str, Path]]:
    files = [(run.run_file.name, run.run_file), (run.journal_file.name, run.journal_file)]
    for folder in (run.status_dir, run.metrics_dir, run.diagnostics_dir, run.logs_dir):
        if folder.is_dir():  # logs/ holds torchrun's per-attempt, per-rank folders
            found = [p for p in sorted(folder.rglob("*"))
                     if p.is_file() and not p.name.startswith(".")][:MAX_FILES_PER_FOLDER]
            files += [(f"{folder.name}/{p.relative_to(folder)}", p) for p in found]
    return [(name, p) for name, p in files if p.is_file()]


def _tail(path: Path, root: Path) -> str:
    """The file's end, by the safe reader: a link out of the run directory or a FIFO put
    there must not put another file in the bundle or hang diagnose."""
    try:
        data = read_run_file_tail(path, root, max_bytes=TAIL_BYTES)
    except SkippedFile as exc:
        return f"(not read: {exc.detail})\n"
    except OSError as exc:
        return f"(unreadable: {exc.strerror})\n"
    text = data.decode("utf-8", "replace")
    try:  # a whole JSON document is redacted structurally too (keys like "hf_token")
        return json.dumps(redact(json.loads(text)))
    except ValueError:
        return text


def environment(pid: int | None) -> dict[str, str] | None:
    """A local rank's environment (from /proc; None without permission or process)."""
    if not isinstance(pid, int):
        return None
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode("utf-8", "replace").partition("=")
        if sep:
            env[key] = value
    return env


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, default=str) + "\n").encode()
